"""The Python API: the CLI's commands as functions (`posttrain.sft`, `rl`, `dpo`, `distill`, `evaluate`,
`generate`), plus `demo_task`, the demo's data and starting model for notebooks.

Training functions take what `posttrain sft|rl|dpo|distill CONFIG.yaml key=value ...` takes:

- `config`: a YAML file, a mapping with the same nesting as the YAML, or None (the command's defaults);
- overrides, as keyword arguments with each dot written as a double underscore (`trainer__max_steps=3`),
  and/or as a mapping `overrides={"trainer.max_steps": 3}` (or a list of `"key=value"` strings); keyword
  arguments apply last. Values are Python values (str, numbers, bools, None, lists, dicts) and reach the config
  as the command line's text would (a list as `[...]`, True as `true`), so the same checks apply: an unknown or
  ill-typed key is a `posttrain.config.ConfigError` naming it.

They run the command's own code (`run_sft`, `run_rl`, `run_dpo`, `run_distill`: the same files under
`output_dir`, the same resume) and return a `RunResult`. `evaluate` and `generate` call the runs `posttrain eval`
and `posttrain generate` call (`posttrain.eval.run.run_eval`, `posttrain.rollout.generate.run_generate`) with
those commands' options as keyword arguments, named as their flags (`max_new_tokens=32` for `--max-new-tokens 32`,
`chat=True` for `--chat`, `chat=False` for `--no-chat`, a list for a comma-separated value), and return what the
runs wrote. Bad input raises
the package's typed errors (`ConfigError`, `DataError`, `CheckpointError`, ...: the CLI prints them as one line),
never `SystemExit`; an unknown option is a `TypeError` naming it. Sampling from Python without files: `Policy`
(`posttrain.rollout.policy`). Nothing here loads JAX until a function is called, so `import posttrain` stays
light.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported on first use (`__getattr__`): their modules load JAX
    from posttrain.eval.run import EvalResult
    from posttrain.rollout.generate import GenerateResult
    from posttrain.rollout.policy import Policy

__all__ = ["DemoTask", "EvalResult", "GenerateResult", "Policy", "RunResult", "demo_task", "distill", "dpo",
           "evaluate", "generate", "override_strings", "rl", "sft"]


def __getattr__(name: str):
    """`Policy` and the runs' result types, `EvalResult` and `GenerateResult`, imported on first use (their modules
    load JAX)."""
    if name == "Policy":
        # lazy: the policy loads JAX
        from posttrain.rollout.policy import Policy

        return Policy
    if name == "EvalResult":
        # lazy: the eval run loads JAX, which `import posttrain.api` does not
        from posttrain.eval.run import EvalResult

        return EvalResult
    if name == "GenerateResult":
        # lazy: the generate run loads JAX
        from posttrain.rollout.generate import GenerateResult

        return GenerateResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What a training run left in its output folder.

    command: "sft", "rl", "dpo" or "distill".

    output_dir: the run's folder (`output_dir` of the config).

    hf_dir: OUTPUT_DIR/hf, the final Hugging Face export (None when `export_hf` is off or the run has not
    reached `trainer.max_steps`).

    config_path: OUTPUT_DIR/config.yaml, the resolved config the run used.

    metrics: the last logged value of every metric in OUTPUT_DIR/metrics.jsonl (held-out ones included), and
    `step`, the last logged step.

    summary: what the run function returned (`SFTResult`, `RLResult`, `DPOResult`, or distillation's summary line).
    """

    command: str
    output_dir: Path
    hf_dir: Path | None
    config_path: Path
    metrics: dict[str, Any]
    summary: Any = dataclasses.field(default=None, repr=False, compare=False)

    def history(self, key: str) -> list[tuple[int, Any]]:
        """`(step, value)` of every row of OUTPUT_DIR/metrics.jsonl that logged `key`, in order."""
        return [(row["step"], row[key]) for row in metrics_rows(self.output_dir / "metrics.jsonl")
                if key in row and "step" in row]


@dataclasses.dataclass(frozen=True)
class DemoTask:
    """The demo's task written by `demo_task`: a random starting model and its data files.

    model: a small random Llama-shaped HF checkpoint with a character tokenizer (`posttrain demo`'s).

    sft_data: `prompt` + `completion` records (`#### n` answers; some without the worked steps).

    rl_prompts, heldout: `prompt` + `answer` records; held-out prompts appear in neither training file.
    """

    model: Path
    sft_data: Path
    rl_prompts: Path
    heldout: Path


def metrics_rows(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file (none when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _text(value: Any) -> str:
    """A Python value as the command line writes it: strings as they are, everything else as JSON (YAML reads
    JSON: true, null, numbers, [..], {..})."""
    if isinstance(value, (str, Path)):
        return str(value)
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _flatten(prefix: str, value: Any) -> Iterable[tuple[str, Any]]:
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            yield from _flatten(f"{prefix}.{k}" if prefix else str(k), v)
    else:
        yield prefix, value


def override_strings(overrides: Mapping | Iterable[str] | None = None, **kwargs: Any) -> list[str]:
    """`key=value` strings, as `posttrain CMD CONFIG key=value ...` takes them, from a mapping of dotted keys (or
    nested mappings), a list of `key=value` strings, and keyword arguments whose `__` stand for dots."""
    out: list[str] = []
    if isinstance(overrides, Mapping):
        out += [f"{k}={_text(v)}" for k, v in _flatten("", overrides)]
    elif overrides is not None:
        items = [overrides] if isinstance(overrides, str) else list(overrides)
        bad = [x for x in items if not isinstance(x, str) or "=" not in x]
        if bad:
            raise TypeError(f"overrides: expected a mapping or 'key=value' strings, found {bad[0]!r}")
        out += items
    return out + [f"{k.replace('__', '.')}={_text(v)}" for k, v in kwargs.items()]


def _config_and_overrides(config, overrides, kwargs) -> tuple[str | None, list[str]]:
    """A config path (or None) and the override strings: a mapping given as `config` becomes overrides first."""
    if isinstance(config, Mapping):
        return None, override_strings(config) + override_strings(overrides, **kwargs)
    if config is not None and not isinstance(config, (str, Path)):
        raise TypeError(f"config: expected a YAML path, a mapping or None, found {type(config).__name__}")
    return (None if config is None else str(config)), override_strings(overrides, **kwargs)


def _start() -> None:
    """What the CLI does before every command: JAX's persistent compilation cache (unless
    POSTTRAIN_COMPILE_CACHE=0)."""
    # lazy: compile_cache imports JAX, which `import posttrain` does not load
    from posttrain import compile_cache

    compile_cache.enable()


def _train(command: str, load: Callable, run: Callable, config, overrides, kwargs) -> RunResult:
    """Loads the config as the command does, runs it, and reads back what it wrote."""
    # lazy: distributed imports JAX
    from posttrain import distributed

    path, strings = _config_and_overrides(config, overrides, kwargs)
    cfg = load(path, strings)
    _start()
    summary = run(cfg)
    distributed.finish()  # several processes: every one waits for the others (process 0's export), as the CLI does
    out = Path(cfg.output_dir)
    rows = metrics_rows(out / "metrics.jsonl")
    metrics = {k: v for row in rows for k, v in row.items() if isinstance(v, (int, float, str, bool))}
    hf = out / "hf"
    return RunResult(command=command, output_dir=out, hf_dir=hf if (hf / "config.json").exists() else None,
                     config_path=out / "config.yaml", metrics=metrics, summary=summary)


def sft(config: str | Path | Mapping | None = None, *, overrides: Mapping | Iterable[str] | None = None,
        **kwargs: Any) -> RunResult:
    """Supervised fine-tuning, as `posttrain sft CONFIG key=value ...` (full, LoRA with `lora__enabled=True`,
    QLoRA with `lora__quantize="nf4"` too). E.g. `posttrain.sft("configs/sft_smoke.yaml", trainer__max_steps=20)`."""
    # lazy: the SFT run loads JAX and the model code
    from posttrain.training.sft import load_sft_config, run_sft

    return _train("sft", load_sft_config, run_sft, config, overrides, kwargs)


def rl(config: str | Path | Mapping | None = None, *, overrides: Mapping | Iterable[str] | None = None,
       **kwargs: Any) -> RunResult:
    """GRPO-family RL with verifiable rewards, as `posttrain rl CONFIG key=value ...`. E.g.
    `posttrain.rl("configs/rl_smoke.yaml", algorithm__preset="dr_grpo", trainer__max_steps=4)`."""
    # lazy: the RL loop loads JAX, the sampler and the reward pool
    from posttrain.rl.loop import load_rl_config, run_rl

    return _train("rl", load_rl_config, run_rl, config, overrides, kwargs)


def dpo(config: str | Path | Mapping | None = None, *, overrides: Mapping | Iterable[str] | None = None,
        **kwargs: Any) -> RunResult:
    """Preference tuning (DPO, IPO, hinge, robust, cDPO, SimPO, ORPO), as `posttrain dpo CONFIG key=value ...`.
    E.g. `posttrain.dpo("configs/dpo_smoke.yaml", algorithm__loss="ipo")`."""
    # lazy: the DPO run loads JAX and the model code
    from posttrain.training.dpo import load_dpo_config, run_dpo

    return _train("dpo", load_dpo_config, run_dpo, config, overrides, kwargs)


def distill(config: str | Path | Mapping | None = None, *, overrides: Mapping | Iterable[str] | None = None,
            **kwargs: Any) -> RunResult:
    """Knowledge distillation (logit, or `mode="on_policy"`), as `posttrain distill CONFIG key=value ...`.
    E.g. `posttrain.distill("configs/distill_smoke.yaml", teacher__top_k=16)`."""
    # lazy: distillation loads JAX, the teacher and (on-policy) the RL loop
    from posttrain.distill.run import load_distill_config, run_distill

    return _train("distill", load_distill_config, run_distill, config, overrides, kwargs)


def _check_options(cls, function: str, options: Mapping[str, Any]) -> None:
    """Keyword options of the run config `cls`: an unknown one is a TypeError naming it and the accepted ones."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise TypeError(f"posttrain.{function}: unknown option {unknown[0]!r}; accepted: {', '.join(names)}")


def _start_sampling() -> None:
    """What the CLI does before a sampling command: the compilation cache, and several processes joined (from the
    environment or the cluster; else a no-op)."""
    # lazy: distributed imports JAX
    from posttrain import distributed

    _start()
    distributed.initialize()


def evaluate(model: str | Path, data: str | Path, **options: Any):
    """Greedy pass@1, pass@k and maj@k of `model` on `data`, as `posttrain eval --model M --data D ...`; the
    options are that command's (`reward`, `n`, `k`, `temperature`, `chat`, `limit`, `output`, `max_new_tokens`,
    tools...). Returns an `EvalResult`. E.g. `posttrain.evaluate("outputs/rl", "heldout.jsonl", n=8, k=[1, 4, 8],
    limit=100)`."""
    # lazy: the eval run loads JAX
    from posttrain.eval.run import EvalConfig, run_eval

    _check_options(EvalConfig, "evaluate", options)
    _start_sampling()
    return run_eval(EvalConfig(model=model, data=data, **options))


def generate(model: str | Path, prompts: str | Path | Iterable[str | dict], output: str | Path, **options: Any):
    """Completions of `prompts`, as `posttrain generate --model M --prompts P --output O ...` (options:
    `max_new_tokens`, `temperature`, `top_p`, `n`, `chat`, `tools`, ...); returns a `GenerateResult`. `prompts` is
    a JSONL file, or a list of strings (each a `prompt`) or records (`{"prompt": ...}` / `{"messages": [...]}`),
    written to a temporary file."""
    # lazy: the generate run loads JAX
    from posttrain.rollout.generate import GenerateConfig, run_generate

    with contextlib.ExitStack() as stack:
        if not isinstance(prompts, (str, Path)):
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="posttrain-prompts-")))
            path = folder / "prompts.jsonl"
            rows = [{"prompt": p} if isinstance(p, str) else p for p in prompts]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
            prompts = path
        _check_options(GenerateConfig, "generate", options)
        _start_sampling()
        return run_generate(GenerateConfig(model=model, prompts=prompts, output=output, **options))


def demo_task(folder: str | Path, *, seed: int = 0, n_sft: int = 20000, n_rl: int = 4000, n_heldout: int = 500,
              hidden: int = 128, layers: int = 4) -> DemoTask:
    """Writes `posttrain demo`'s task into `folder`: chained additions (`7+15+9=` -> `7+15=22,22+9=31 #### 31`,
    half of the SFT demonstrations without the working), and a random Llama-shaped model of `layers` x `hidden`
    with a character tokenizer, the starting point of an SFT then RL run on CPU."""
    # lazy: the demo's model builder loads JAX
    from posttrain.demo.run import DemoSettings, build_base_model

    # lazy: with the builder above
    from posttrain.demo.task import make_splits, write_jsonl

    out = Path(folder)
    s = DemoSettings(n_train=n_sft, n_rl_prompts=n_rl, n_eval=n_heldout, hidden=hidden, layers=layers)
    train, heldout = make_splits(seed, n_sft + n_rl, n_heldout, max_operand=s.max_operand,
                                 direct_fraction=s.direct_fraction)
    prompts = [{"prompt": r["prompt"], "answer": r["answer"]} for r in train[n_sft:]]
    return DemoTask(model=build_base_model(out, s, seed),
                    sft_data=write_jsonl(train[:n_sft], out / "sft_train.jsonl"),
                    rl_prompts=write_jsonl(prompts, out / "rl_prompts.jsonl"),
                    heldout=write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in heldout],
                                        out / "heldout.jsonl"))
