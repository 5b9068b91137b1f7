"""A sampler host's whole run (`mesh.sampler_processes`): it only produces rollouts for the
trainer process (`rljax.drivers.remote.RemoteSampler`), so it builds the prompt stream, the
verifier and the sampling program, but no policy, optimiser or metrics writer."""

from __future__ import annotations

import jax

from rljax.data.example import verifier_metadata
from rljax.data.pipeline import prompt_batches
from rljax.drivers.overlap import OverlapPrograms
from rljax.drivers.remote import RemoteSampler, sampler_params_like
from rljax.models.setup import build_tokenizer, policy_config
from rljax.rewards import as_callback
from rljax.sharding import abstract_like
from rljax.sharding.placement import Roles, build_layouts, data_processes
from rljax.sharding.transport import Transport
from rljax.stages.iteration import make_stages
from rljax.train.config import TrainConfig
from rljax.train.setup import build_reward, build_splits, prompt_format
from rljax.update.abstract import abstract_train_state


def run_sampler(cfg: TrainConfig, *, log=print) -> int:
    """A sampler host of a remote async run: builds the sampling program on this process's
    devices (no policy is allocated: the first weights come from the trainer) and produces until
    the trainer stops. Returns how many batches it put."""
    roles = Roles.from_mesh(cfg.mesh)
    trainer_layout, sampler_layout = build_layouts(cfg.mesh)
    _, _, k_loop = jax.random.split(jax.random.key(cfg.seed), 3)
    tokenizer = build_tokenizer(cfg.model)
    model_cfg = policy_config(cfg.model, tokenizer)
    state = abstract_train_state(cfg, model_cfg)
    state = abstract_like(state, trainer_layout.tree(state))
    train_set, _, _ = build_splits(cfg.data)
    data = prompt_batches(train_set, tokenizer=tokenizer, batch_size=cfg.rl.prompts_per_iteration, seed=cfg.data.seed,
                          max_prompt_len=cfg.data.max_prompt_tokens, fmt=prompt_format(cfg.data),
                          add_bos=cfg.data.add_bos, **data_processes(cfg.mesh))
    callback = as_callback(build_reward(cfg.reward), tokenizer, [verifier_metadata(e) for e in data.examples])
    stages = make_stages(cfg.sampling.with_tokenizer(tokenizer), callback, state,
                         num_prompts=cfg.rl.prompts_per_iteration, trainer=trainer_layout, sampler=sampler_layout)
    programs = OverlapPrograms.from_stages(stages)
    transport = Transport.start(timeout_s=cfg.mesh.transport_timeout_s)
    producer = RemoteSampler(programs, stages.split.prompts_sh, sampler_params_like(programs, state),
                             iter(data.dataset), transport, roles, k_loop, cfg.rl.max_staleness, cfg.rl.queue_batches,
                             cfg.rl.stale_rows == "wait", cfg.rl.prompts_per_iteration * cfg.sampling.num_samples,
                             callback=callback, log=log)
    n = producer.run()
    log(f"sampler process {roles.process}: {n} batches put; the trainer stopped")
    return n
