"""`searchrl train FILE --dry-run`: build every stage as `train` would, and stop before the first step.

What `validate` checks from the file alone (`searchrl.app.experiment.check_arguments`, `check_paths`), and then
what needs the inputs themselves: the run directory against the file (`searchrl.app.rundir.check_run_dir`), the
question files of every split a stage or the evaluation reads, the retriever's index over the corpus, the
environment, the model's tokenizer and chat template against the protocol and template, the longest training
prompt against ``rollout.max_total_tokens``, each stage's batch shape, and the model itself built on the meta
device (no weights read, no memory). A local model the experiment builds (the synthetic world's) is built and
kept, as `train` would build it first. Nothing is trained and nothing of a run is written.
"""

from __future__ import annotations

import os
from pathlib import Path

from searchrl.core.config import Experiment
from searchrl.core.errors import ConfigError


def dry_run(exp: Experiment, source: str) -> list[str]:
    """The checks above, in the order `train` meets them, on an experiment `searchrl.app.checks.check_experiment`
    accepted (and returned, resolved); a line per thing built. Raises what `train` would."""
    from searchrl.algorithms import requirements
    from searchrl.app.experiment import _local_path
    from searchrl.app.plan import WARM, plan
    from searchrl.app.resources import Resources
    from searchrl.app.rundir import check_run_dir
    from searchrl.engine.schedule import batch_shape

    lines: list[str] = []
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    p = plan(exp)  # `check_experiment` (app.checks) has already run the stage checks on it
    try:
        check_run_dir(exp, force=False, resume=True)  # a directory trained with another config
        resources = Resources(exp)
        online = any(requirements(s.algorithm, s.config, exp.env).online for s in p.stages)
        splits = sorted({exp.eval.split} | ({"train"} if online or p.teacher_passes else set()))
        examples = {split: resources.examples(split) for split in splits}
        lines += [f"data: {len(v)} {k} questions" for k, v in examples.items()]
        if online and not examples["train"]:
            raise ConfigError("no train questions", key="data.train")
        remote = exp.model.path is not None and not _local_path(str(exp.model.path))
        if remote:
            lines.append(
                f"model: {exp.model.path} (a hub id: not fetched here; its tokenizer is checked at train)"
            )
        else:
            path, tok = resources.model_tokenizer  # the local model is built here if the run builds one
            lines.append(f"model: {path} (tokenizer: {type(tok).__name__}, {len(tok)} tokens)")
            env = (
                resources.env()
            )  # the retriever's index over the corpus, the chat template against the protocol
            lines.append(f"environment: {exp.env.protocol} protocol, retriever {exp.env.retriever.name}")
            if online and exp.env.protocol == "tags":
                from searchrl.rollout.loop import check_prompt_room

                check_prompt_room(env, tok, examples["train"], exp.rollout.max_total_tokens)
            lines.append(f"parameters: {_meta_parameters(path, exp):,} (built on the meta device)")
        for stage in p.stages:
            req = requirements(stage.algorithm, stage.config, exp.env)
            rows, micro, accum = batch_shape(stage.trainer, req, stage.algorithm, world)
            where = "warm start" if stage.name == WARM else "stage"
            lines.append(
                f"{where} {stage.name}: {stage.trainer.steps} steps of {rows} rows per process, micro-batches of "
                f"{micro}, {accum} accumulated"
            )
    except ConfigError as exc:
        raise exc.at(source) from None
    return lines


def _meta_parameters(path: Path, exp: Experiment) -> int:
    """The model's parameter count, built from its config on the meta device (with its LoRA adapter)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if exp.model.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = exp.model.lora
        model = get_peft_model(
            model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules))
        )
    return sum(p.numel() for p in model.parameters())
