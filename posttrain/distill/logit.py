"""Logit distillation: SFT data -> student and frozen teacher in one compiled step -> the distillation loss.

On the shared run skeleton (`posttrain.training.run.Run`): the data pipeline is SFT's (same formats, loss
masks, packing, exact resume of the data position), the teacher is a frozen model the trainer passes into
the compiled step as an argument (no optimizer state, never checkpointed: it comes back from its own
checkpoint), and the loss is `posttrain.distill.logit_loss.logit_distill_loss`. With `teacher.top_k` the
teacher instead scores the run's batches once before training (`TopKStore`, under OUTPUT_DIR/teacher_topk/),
is released, and each step reads its stored top-k.

Held-out evaluation (data.eval, every trainer.eval_every steps and at the end): eval/divergence (the
configured T^2 D(teacher || student) per target token), eval/ce and eval/top1_agreement (the student's most
likely next token is the teacher's).

Multi-host: as SFT, every process reads its rows of every global batch; the teacher is sharded on the same
mesh; with `teacher.top_k` the store holds the teacher's scores of whole global batches (scored on the global
mesh, written by process 0) and each process reads its rows of them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from posttrain import distributed
from posttrain.algorithms.distill import make_token_loss
from posttrain.algorithms.protocol import reduce_metrics, uses_frozen
from posttrain.config import ConfigError
from posttrain.data import build_sft_dataset
from posttrain.data.pipeline import too_long_warning
from posttrain.distill.logit_loss import TopKStore, make_logit_distill_loss, teacher_topk_fn
from posttrain.distill.teacher import check_same_vocabulary, load_teacher, teacher_folder
from posttrain.models import tokenizer as tok_lib
from posttrain.training.run import Run
from posttrain.training.sft import eval_batches

__all__ = ["LogitResult", "run_logit"]


@dataclasses.dataclass
class LogitResult:
    output_dir: Path
    losses: list[tuple[int, float]]
    final_step: int
    start_step: int
    evals: list[dict[str, float]]
    hf_dir: Path | None
    trainer: Any = None


def heldout_metrics(trainer, batches: list[dict], loss_fn) -> dict[str, float]:
    """The loss's per-token metrics over `batches` (sums over batches, then ratios), named eval/*."""
    tot: dict[str, Any] = {}
    for b in batches:
        _, _, m = trainer.eval_sums(b, loss_fn)
        for k, v in m.items():
            if isinstance(v, tuple):
                prev = tot.get(k, (0.0, 0.0))
                tot[k] = (prev[0] + v[0], prev[1] + v[1])
            else:
                tot[k] = tot.get(k, 0.0) + v
    return {"eval/" + k.removeprefix("distill/"): float(v) for k, v in reduce_metrics(tot).items()
            if k.startswith("distill/")}


def _stored_topk(cfg, run, teacher, ds_kw: dict, rows, eval_data: list[dict]):
    """The teacher's top-k of the run's `teacher.top_k` store (scored now unless process 0 finds it complete),
    and the held-out batches with their own top-k; returns (store, eval batches)."""
    d, lc, tc = cfg.data, cfg.loss, cfg.trainer
    score = teacher_topk_fn(teacher, cfg.teacher.top_k, lc.temperature, tc.loss_chunk_size or None,
                            put=run.trainer.put_batch)
    meta = {"teacher": cfg.teacher.path, "k": cfg.teacher.top_k, "temperature": lc.temperature, "steps": tc.max_steps,
            "data": d.train, "format": dataclasses.asdict(d.format),
            **{key: v for key, v in ds_kw.items() if key != "num_epochs"}}
    store = TopKStore(run.out / "teacher_topk", meta)
    if not distributed.broadcast_json(store.complete()):  # process 0's verdict: every process scores
        # the run's own batches, in its order: the same pipeline from the start
        store.build(iter(build_sft_dataset(d.train, run.tokenizer(), d.format, batch_rows=rows, **ds_kw)), score,
                    tc.max_steps, run.say)
    keys = ("teacher_logp", "teacher_ids")
    return store, [{**b, **run.local_rows(dict(zip(keys, score(b))), rows)} for b in eval_data]


def run_logit(cfg, *, stop_after: int | None = None, batch_hook: Callable[[int, dict], dict] | None = None,
              log: Callable[[str], None] | None = None) -> LogitResult:
    """Runs (or resumes) logit distillation as `cfg` (a `DistillConfig` with mode=logit) says."""
    tc, d, lc = cfg.trainer, cfg.data, cfg.loss
    if d.batch_size % tc.grad_accum:
        raise ConfigError(f"data.batch_size={d.batch_size} must be divisible by trainer.grad_accum={tc.grad_accum}")
    chunk = tc.loss_chunk_size or None
    loss = make_logit_distill_loss(make_token_loss(lc.kind, lc.beta, lc.temperature, lc.alpha,
                                                   tail=cfg.teacher.top_k_tail), chunk)
    k = cfg.teacher.top_k
    with Run(cfg, "distill", log=log) as run:
        # data and the teacher's tokenizer first: bad data or another vocabulary fail before any weight loads
        tok = run.tokenizer()
        check_same_vocabulary(tok, tok_lib.load(teacher_folder(cfg.teacher)), student=cfg.model.path,
                              teacher=cfg.teacher.path)
        ds_kw = dict(seq_len=d.seq_len, batch_size=d.batch_size, pack=d.pack, seed=d.seed, shuffle=d.shuffle,
                     num_epochs=None, truncation=d.truncation, split=d.train_split)
        rows = run.batch_rows(d.batch_size)  # multi-host: this process's rows of every global batch
        train_ds = build_sft_dataset(d.train, tok, d.format, batch_rows=rows, **ds_kw)
        if (warning := too_long_warning(train_ds.stats, d.seq_len)) is not None:
            run.say(f"warning: data.train: {warning}")
        eval_data = eval_batches(d, tc.eval_batches, tok, rows) if d.eval else []
        loss_fn = loss if k else uses_frozen(loss, "teacher")
        trainer = run.build_trainer(loss_fn, process_local_batches=True)
        teacher = load_teacher(cfg.teacher, cfg.model, tok, trainer.cfg.vocab_size, run.mesh)
        it = iter(train_ds)
        run.restore(it)
        run.open_logger()
        hook = batch_hook
        if k:
            if k > trainer.cfg.vocab_size:
                raise ConfigError(f"teacher.top_k={k} is more than the vocabulary ({trainer.cfg.vocab_size})")
            store, eval_data = _stored_topk(cfg, run, teacher, ds_kw, rows, eval_data)
            del teacher  # training holds no teacher

            def with_topk(step, batch):
                batch = {**batch, **run.local_rows(store.get(step), rows)}
                return batch_hook(step, batch) if batch_hook is not None else batch

            hook = with_topk
        else:
            trainer.add_frozen("teacher", teacher)
            del teacher
        how = (f"top-{k} stored" + (" + rest" if cfg.teacher.top_k_tail else "")) if k else "full logits"
        run.say(f"distill: {cfg.model.path} <- teacher {cfg.teacher.path} ({how}, {lc.kind}, T={lc.temperature}, "
                f"alpha={lc.alpha}) | {trainer.num_trainable:,} trained parameters | {train_ds.num_rows} rows of "
                f"{d.seq_len} tokens | steps {run.start_step}->{tc.max_steps}")
        evals: list[dict[str, float]] = []

        def evaluate() -> dict[str, float]:
            e = heldout_metrics(trainer, eval_data, loss_fn)
            evals.append({"step": trainer.step_count, **e})
            return e

        if eval_data and run.start_step == 0:
            run.logger.log(0, evaluate())
        fit = run.fit(it, loss_fn=loss_fn, evaluate=evaluate if eval_data else None, stop_after=stop_after,
                      batch_hook=hook, seq_len=d.seq_len)
        if eval_data and tc.eval_every <= 0 and run.finished and fit.final_step > fit.start_step:
            run.logger.log(fit.final_step, evaluate())  # the skeleton evaluates only with eval_every
        hf_dir = run.export_hf(prompt_style=train_ds.prompt_style) if run.finished else None
    return LogitResult(output_dir=run.out, losses=fit.losses, final_step=fit.final_step, start_step=fit.start_step,
                       evals=evals, hf_dir=hf_dir, trainer=trainer)
