"""Unit tests for behemoth.train.config and the trainer's pure pieces (no processes)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from behemoth import Plan
from behemoth.train.config import Config, format_config, load_config, parse_overrides
from behemoth.train.config_sections import ConfigError, DataSection, ModelSection, OptimSection, TrainSection
from behemoth.train.trainer import lr_at

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "src", "behemoth", "configs", "demo.toml")


def write(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ loading
def test_demo_config_loads():
    cfg = load_config(DEMO)
    assert cfg.model.name == "gpt-mini" and cfg.data.source == "default" and cfg.data.tokenizer == "byte"
    assert cfg.plan == Plan()  # dp fills the world size: one process, `make train NPROC=2`, the default 4
    for world_size in (1, 2, 4):
        assert cfg.resolved(world_size=world_size).plan.dp == world_size


def test_toml_sections_and_defaults(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            """
[model]
name = "gpt-tiny"
seq_len = 64
[optim]
lr = 1e-3
betas = [0.8, 0.9]
max_grad_norm = "none"
[plan]
dp = 2
microbatches = 2
[train]
steps = 7
global_batch_size = 8
""",
        )
    )
    assert cfg.model == ModelSection(name="gpt-tiny", seq_len=64)
    assert cfg.optim.lr == 1e-3 and cfg.optim.betas == (0.8, 0.9) and cfg.optim.max_grad_norm is None
    assert cfg.plan == Plan(dp=2, microbatches=2)
    assert cfg.train == TrainSection(steps=7, global_batch_size=8)
    assert cfg.data == DataSection()


def test_overrides_parse_toml_literals_else_strings():
    got = parse_overrides(
        [
            "--train.steps=10",
            "--optim.lr=2e-3",
            "--train.resume=false",
            "--optim.betas=[0.9, 0.99]",
            "--data.source=my data.txt",
            "--model.name=gpt-tiny",
            '--train.out_dir="runs/x"',
            "--plan.offload=none",
        ]
    )
    assert got == {
        "train": {"steps": 10, "resume": False, "out_dir": "runs/x"},
        "optim": {"lr": 2e-3, "betas": [0.9, 0.99]},
        "data": {"source": "my data.txt"},
        "model": {"name": "gpt-tiny"},
        "plan": {"offload": "none"},
    }


def test_overrides_apply_on_top_of_the_file():
    cfg = load_config(DEMO, ["--train.steps=3", "--optim.lr=1", "--plan.dp=2", '--data.source=["a.txt", "b.jsonl"]'])
    assert cfg.train.steps == 3
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)  # an int literal becomes a float
    assert cfg.plan.dp == 2
    assert cfg.data.source == ("a.txt", "b.jsonl")
    assert cfg.model.name == "gpt-mini"  # untouched keys keep the file's value


def test_resolved_fills_vocab_shape_and_dp():
    cfg = load_config(None, ["--plan.dp=none", "--train.global_batch_size=12"]).resolved(world_size=3)
    assert cfg.model.vocab_size == 257 and (cfg.model.num_layers, cfg.model.hidden) == (4, 128)
    assert cfg.plan.dp == 3
    big = load_config(None, ["--data.tokenizer=gpt2", "--model.num_layers=2"]).resolved()
    assert big.model.vocab_size == 50257 and big.model.num_layers == 2


def test_format_round_trips(tmp_path):
    cfg = load_config(DEMO, ["--optim.max_grad_norm=none", '--data.source=["a.txt"]']).resolved(world_size=4)
    text = format_config(cfg)
    assert "[plan]" in text and 'offload                  = "none"' in text
    assert load_config(write(tmp_path, text)) == cfg
    json.dumps(cfg.to_dict())  # JSON-serialisable (it goes into checkpoints)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "override, names",
    [
        (["--train.stpes=3"], ["'train.stpes'", "Did you mean 'train.steps'", "train.global_batch_size"]),
        (["--trian.steps=3"], ["'trian'", "Did you mean 'train'", "model, data, optim, plan, train"]),
        (["--model.layers=3"], ["'model.layers'", "model.num_layers"]),
        (["steps=3"], ["'steps=3'", "--section.key=value"]),
    ],
)
def test_unknown_names_are_named_with_the_valid_ones(override, names):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, override)
    for n in names:
        assert n in str(e.value)


def test_renamed_plan_keys_name_their_new_name(tmp_path):
    """plan.sp / plan.sp_mode became plan.cp / plan.cp_mode (context parallelism)."""
    for source in ("file", "override"):
        for old, new, value in (("sp", "cp", "2"), ("sp_mode", "cp_mode", '"ring"')):
            with pytest.raises(ConfigError) as e:
                if source == "file":
                    load_config(write(tmp_path, f"[plan]\n{old} = {value}\n"))
                else:
                    load_config(DEMO, [f"--plan.{old}={value}"])
            assert f"'plan.{old}' is now 'plan.{new}'" in str(e.value), (source, str(e.value))
    cfg = load_config(write(tmp_path, '[plan]\ncp = 2\ncp_mode = "ring"\n'))
    assert (cfg.plan.cp, cfg.plan.cp_mode) == (2, "ring")


def test_unknown_section_or_key_in_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config section 'trainer'.*Valid sections"):
        load_config(write(tmp_path, "[trainer]\nsteps = 1\n"))
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.learning_rate'.*optim.lr"):
        load_config(write(tmp_path, "[optim]\nlearning_rate = 1\n"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[optim\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.toml"))


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("--train.steps=abc", "train.steps='abc': expected an integer"),
        ("--train.steps=0", "train.steps=0: must be an integer >= 1"),
        ("--train.steps=2.5", "train.steps=2.5: expected an integer"),
        ("--optim.lr=-1", "optim.lr=-1.0: must be a number > 0"),
        ("--optim.betas=[0.9]", "optim.betas=[0.9]: expected a list of 2 numbers"),
        ("--optim.name=adam", 'optim.name=\'adam\': must be "adamw" or "sgd"'),
        ("--optim.max_grad_norm=0", 'or "none" to disable clipping'),
        ("--train.resume=yes", "train.resume='yes': expected true or false"),
        ("--model.name=gpt-huge", "model.name='gpt-huge' is not a known preset"),
        ("--model.dropout=1.5", "model.dropout=1.5: must satisfy 0 <= dropout < 1"),
        ("--data.tokenizer=bpe", "data.tokenizer='bpe': must be one of ['byte', 'gpt2']"),
        ("--data.source=corpus.csv", "unsupported type"),
        ('--data.source=["a.bin", "b.bin"]', "must be the only source"),
        ("--plan.tp=0", "[plan] Plan.tp=0: must be an integer >= 1"),  # Plan's own validation, surfaced
        ("--plan.tp_mode=4d", "Plan.tp_mode='4d' is not one of"),
        ("--plan.tp=3", "must equal the world size 4"),
        ("--train.global_batch_size=30", "not divisible by plan.dp * plan.microbatches = 4 * 1 = 4"),
        ("--model.vocab_size=100", "model.vocab_size=100 is smaller than the 'byte' tokenizer's 257 ids"),
        ("--train.async_checkpoint=1", "train.async_checkpoint=1: expected true or false"),
        ("--train.wandb_mode=offline", "train.wandb_mode='offline' configures Weights & Biases logging, which is off"),
    ],
)
def test_bad_values_name_the_value_and_the_rule(override, fragment):
    with pytest.raises(ConfigError) as e:
        cfg = load_config(DEMO, ["--plan.dp=4", override])  # the demo's own dp fills the world size
        cfg.resolved(world_size=4)
    assert fragment in str(e.value)


def test_wandb_and_async_checkpoint_keys():
    cfg = load_config(DEMO, ["--train.wandb_project=p", "--train.wandb_mode=offline"])
    assert (cfg.train.wandb_project, cfg.train.wandb_mode, cfg.train.async_checkpoint) == ("p", "offline", True)
    assert load_config(DEMO, ["--train.async_checkpoint=false"]).train.async_checkpoint is False
    with pytest.raises(ConfigError, match="train.wandb_mode='cloud': must be one of 'online', 'offline', 'disabled'"):
        load_config(DEMO, ["--train.wandb_project=p", "--train.wandb_mode=cloud"])


def test_resolve_checks_the_world_size():
    with pytest.raises(ConfigError, match="must equal the world size 2"):
        load_config(DEMO, ["--plan.dp=4"]).resolved(world_size=2)


def test_sections_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        OptimSection(1e-3)  # the point is that it fails
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().train.steps = 5  # type: ignore[misc]


# ------------------------------------------------------------------ trainer pure pieces
def test_lr_schedule_warmup_then_cosine_to_the_floor():
    opt = OptimSection(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    lrs = [lr_at(s, opt, 20) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))  # non-increasing after warm-up
    assert lrs[-1] == pytest.approx(0.1)
    const = OptimSection(lr=0.5, schedule="constant")
    assert {lr_at(s, const, 10) for s in range(10)} == {0.5}
