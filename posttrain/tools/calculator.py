"""The built-in `calculator` tool: arithmetic on numbers evaluated from the `ast` of the expression (no `eval`).

Accepted: int and float literals, `+ - * / // % **`, unary `-`/`+` and parentheses. Anything else (names,
calls, attributes, comparisons, strings...) is refused. Exponents and results are bounded, so no expression can
take long or much memory. Every problem comes back as a message string starting with `Error:`.
"""

from __future__ import annotations

import ast
import math
import operator

__all__ = ["calculator", "MAX_EXPRESSION_CHARS", "MAX_RESULT_DIGITS"]

MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_DIGITS = 1000
_MAX_INT = 10**MAX_RESULT_DIGITS

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class _CalcError(Exception):
    pass


def _power(base, exp):
    if isinstance(base, int) and isinstance(exp, int) and exp >= 0:
        digits = math.log10(abs(base)) * exp if abs(base) > 1 else 1
        if digits > MAX_RESULT_DIGITS:
            raise _CalcError(f"result would have about {int(digits)} digits (limit {MAX_RESULT_DIGITS})")
    elif abs(exp) > 10_000:
        raise _CalcError("exponent too large")
    out = base ** exp
    if isinstance(out, complex):
        raise _CalcError("the result is not a real number")
    return out


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        out = _power(left, right) if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        out = _UNARY[type(node.op)](_eval(node.operand))
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise _CalcError("'^' is not a power here: use '**'")
    else:
        raise _CalcError(f"unsupported element {type(node).__name__!s}: only numbers, + - * / // % ** and parentheses")
    if isinstance(out, int) and abs(out) >= _MAX_INT:
        raise _CalcError(f"result has more than {MAX_RESULT_DIGITS} digits")
    if isinstance(out, float) and not math.isfinite(out):
        raise _CalcError("result is not finite")
    return out


def _format(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12.5 + 3) * 4 ** 2"
    """
    if not isinstance(expression, str):
        return f"Error: expression must be a string, got {type(expression).__name__}"
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"Error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        return f"Error: cannot parse {expression!r}: {e.msg}"
    except (RecursionError, MemoryError):
        return "Error: expression nested too deeply"
    try:
        return _format(_eval(tree))
    except _CalcError as e:
        return f"Error: {e}"
    except ZeroDivisionError:
        return "Error: division by zero"
    except (OverflowError, ValueError, RecursionError, MemoryError) as e:
        return f"Error: {type(e).__name__}: {e}"
