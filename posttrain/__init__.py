"""posttrain: a JAX-native post-training stack (SFT, LoRA/QLoRA, DPO, distillation, GRPO-family RL).

The Python API (`posttrain.api`) is reached from here and loads on first use, so `import posttrain` loads no JAX:
`posttrain.sft(...)`, `posttrain.rl(...)`, `posttrain.dpo(...)`, `posttrain.distill(...)`,
`posttrain.evaluate(...)`, `posttrain.generate(...)`, `posttrain.demo_task(...)`, and `posttrain.Policy` (a
checkpoint opened once, to sample and score from Python).

`posttrain.rl` and `posttrain.distill` are also subpackages (`posttrain.rl.config`, ...): the package object is the
subpackage, and calling it calls the API function of that name. Python sets a subpackage as an attribute of its
parent when it is imported, so this package's module class makes those two subpackages callable as they arrive.
"""

__version__ = "0.1.0"

import importlib as _importlib
import os as _os
import sys as _sys
import types as _types

# transformers prints "PyTorch was not found..." (an advisory warning) on import; posttrain needs only its
# tokenizers and configs, which work without torch.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

#: Names of `posttrain.api` reachable as `posttrain.NAME`.
API = ("sft", "rl", "dpo", "distill", "evaluate", "generate", "demo_task", "Policy", "RunResult", "EvalResult",
       "GenerateResult", "DemoTask")
#: API functions that share their name with a subpackage.
_CALLABLE_PACKAGES = ("rl", "distill")


def _api():
    return _importlib.import_module("posttrain.api")


class _CallablePackage(_types.ModuleType):
    """A subpackage that is also an API function: `posttrain.rl(...)` runs `posttrain.api.rl(...)`."""

    def __call__(self, *args, **kwargs):
        return getattr(_api(), self.__name__.rpartition(".")[2])(*args, **kwargs)


class _Package(_types.ModuleType):
    """This package's module class: a subpackage named in `_CALLABLE_PACKAGES` becomes callable when the import
    system sets it as an attribute here."""

    def __setattr__(self, name, value):
        if name in _CALLABLE_PACKAGES and type(value) is _types.ModuleType:
            value.__class__ = _CallablePackage
        super().__setattr__(name, value)


def __getattr__(name):
    if name in _CALLABLE_PACKAGES:
        return _importlib.import_module(f"{__name__}.{name}")  # the import sets it here, callable
    if name in API:
        return getattr(_api(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(API))


_sys.modules[__name__].__class__ = _Package
