"""The driver table (`rljax.drivers.registry`): which driver runs a config, and the one check that
refuses what a driver does not support, each refusal one line naming the keys."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from rljax.drivers import DRIVERS, FEATURES, check_features, driver_name
from rljax.errors import ConfigError


def fake_cfg(mode="sync", **on):
    """A config-shaped namespace with the named features on (`FEATURES` reads only these)."""
    rl = NS(mode=mode, resample_round_size=8 if on.get("resampling") else 0,
            replay=NS(capacity=4 if on.get("replay") else 0), dynamic_sampling=on.get("dynamic_sampling", False),
            partial_rollouts=on.get("partial_rollouts", False))
    mesh = NS(sampler="tensor" if on.get("tensor_sampler") else "shared",
              sampler_devices=1 if on.get("sampler_devices") else 0,
              sampler_processes=1 if on.get("sampler_processes") else 0)
    data = NS(is_mixture=on.get("mixture", False), prompt_buckets=(16,) if on.get("prompt_buckets") else (),
              source="visual" if on.get("images") else "reasoning_gym")
    model = NS(vision=NS(enabled=on.get("images", False)), checkpoint=None)
    cfg = NS(rl=rl, mesh=mesh, data=data, model=model, env=NS(enabled=on.get("env", False)))
    cfg.host_batching = data.is_mixture or bool(rl.resample_round_size or rl.replay.capacity)
    return cfg


@pytest.mark.parametrize("mode, on, name", [
    ("sync", {}, "sync"), ("sync", {"env": True}, "episodes"), ("sync", {"mixture": True}, "host"),
    ("sync", {"replay": True, "env": True}, "host"), ("one_step_off", {}, "one_step_off"),
    ("async", {}, "async"), ("async", {"sampler_processes": True}, "remote"),
])
def test_driver_name(mode, on, name):
    """Host batching wins over an env (which the host driver then refuses); processes make async remote."""
    assert driver_name(fake_cfg(mode, **on)) == name


def _enabling(name: str) -> dict:
    """The settings that select driver `name` (and what it needs)."""
    return {"sync": ("sync", {}), "episodes": ("sync", {"env": True}), "host": ("sync", {"mixture": True}),
            "one_step_off": ("one_step_off", {"sampler_devices": True}),
            "async": ("async", {"sampler_devices": True}),
            "remote": ("async", {"sampler_processes": True})}[name]


# What each driver runs, written out here from what the drivers implement (docs/architecture.md's
# table), not read from `DRIVERS`: a table entry that drifts from it fails below.
SUPPORTED = {
    "sync": {"dynamic_sampling", "tensor_sampler", "sampler_devices", "prompt_buckets", "images"},
    "episodes": {"env", "sampler_devices", "prompt_buckets"},
    "host": {"mixture", "resampling", "replay", "dynamic_sampling", "tensor_sampler", "sampler_devices",
             "prompt_buckets"},
    "one_step_off": {"tensor_sampler", "sampler_devices"},
    "async": {"tensor_sampler", "sampler_devices", "prompt_buckets", "partial_rollouts"},
    "remote": {"tensor_sampler", "sampler_processes"},
}


@pytest.mark.parametrize("name", sorted(DRIVERS))
def test_each_driver_refuses_exactly_what_it_does_not_support(name):
    """For every driver and every feature: supported -> accepted; not -> one line naming the
    feature's keys. Catches a table entry that forgets a refusal (e.g. one_step_off accepting
    data.prompt_buckets, whose pending batch needs one prompt length: the resume would fail) and
    one that refuses a supported feature."""
    assert DRIVERS[name].supports == SUPPORTED[name]
    mode, base = _enabling(name)
    check_features(fake_cfg(mode, **base))  # the driver's own settings pass
    for feature, (keys, _) in FEATURES.items():
        cfg = fake_cfg(mode, **{**base, feature: True})
        if driver_name(cfg) != name:  # the feature picks another driver (env, mixture, processes)
            continue
        if feature in SUPPORTED[name]:
            check_features(cfg)
        else:
            with pytest.raises(ConfigError) as err:
                check_features(cfg)
            assert keys in str(err.value) and "\n" not in str(err.value)


def test_overlapped_modes_need_their_own_devices():
    with pytest.raises(ConfigError, match="mesh.sampler_devices"):
        check_features(fake_cfg("one_step_off"))
