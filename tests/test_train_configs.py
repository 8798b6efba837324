"""Every experiment and arm composes and validates; bad configs fail at start-up naming the key."""
import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError

from falcon_lab.training.config import compose
from falcon_lab.training.validate import ConfigError, derive_accumulation, validate_config
from train_helpers import arms, experiments, small_overrides

EXPECTED = {"ablate_eta", "ablate_qk_norm", "ablate_window", "ablate_alignment", "ablate_objective",
            "paper_small_transformer", "paper_small_retnet", "paper_small_mamba2", "paper_small_deltanet",
            "paper_small_gated_deltanet", "paper_small_falcon_1a_1", "paper_small_falcon_1a_2",
            "paper_small_falcon_1a_3", "paper_small_falcon_3a_3", "paper_small_falcon_1_3"}


def test_expected_experiments_exist():
    assert EXPECTED <= set(experiments())


@pytest.mark.parametrize("exp", experiments())
def test_every_arm_composes_and_validates(exp):
    all_arms = arms(exp)
    for arm in all_arms:
        cfg = compose(small_overrides(exp) + arm)
        validate_config(cfg)
    if exp.startswith("ablate_"):
        assert len(all_arms) >= 2
        cfgs = [compose([f"experiment={exp}"] + a) for a in all_arms]
        assert len({str(c.mixer) for c in cfgs}) == len(all_arms)  # the arms really differ
        assert {c.logger.experiment_name for c in cfgs} == {exp}  # one MLflow experiment


def test_window_arms_and_paper_rows():
    cfgs = [compose(["experiment=ablate_window"] + a) for a in arms("ablate_window")]
    assert sorted((c.mixer.variant, c.mixer.window) for c in cfgs) == sorted(
        (v, b) for v in ("3", "3A") for b in (1, 2, 4, 8))
    c = compose(["experiment=paper_small_falcon_1a_2"])
    assert (c.model.d_model, c.model.n_layers, c.model.n_heads, c.model.head_dim) == (768, 12, 6, 128)
    assert (c.mixer.variant, c.mixer.preset, c.optim.mup.enabled) == ("1A", ".2", True)
    assert (c.data.global_batch_size, c.trainer.accumulate_grad_batches) == (480, None)  # derived at start-up
    assert derive_accumulation(480, c.data.batch_size, c.trainer.devices, c.trainer.accumulate_grad_batches) == 5


def test_knobs_that_apply_are_accepted():
    for ov in (["mixer.lam=const", "mixer.lam_value=0.5"], ["mixer.preset=.1", "mixer.beta_max=1.5"],
               ["mixer.lam_scale=0.5"], ["mixer.gate=ctx_beta", "mixer.eps=1e-3"]):
        validate_config(compose(ov))


def test_typo_keys_are_rejected_by_name():
    with pytest.raises(ConfigCompositionException, match="windw"):
        compose(["mixer.windw=4"])
    with pytest.raises(ConfigCompositionException, match="lr_max"):
        compose(["optim.lr_max=1"])
    cfg = compose([])
    with pytest.raises(ConfigAttributeError, match="typo"):
        validate_config(cfg)
        cfg.mixer.typo = 1


@pytest.mark.parametrize("overrides,key", [
    (["mixer.window=4"], "mixer.window"),                         # window does not apply to variant 1A
    (["mixer.variant=3", "mixer.window=0"], "mixer.window"),
    (["mixer.variant=7"], "mixer.variant"),
    (["mixer.lam_value=0.5"], "mixer.lam_value"),                 # lam=ctx (preset .3): lam_value unused
    (["mixer.beta_max=1.5"], "mixer.beta_max"),                   # gate=ctx_eta (preset .3)
    (["mixer.lam=off", "mixer.lam_mode=absolute"], "mixer.lam_mode"),
    (["mixer.gate=ctx_gamma"], "mixer.gate"),
    (["mixer.lam_mode=relative"], "mixer.lam_mode"),
    (["mixer=attention", "+mixer.variant=1"], "mixer.variant"),
    (["mixer.name=transformer"], "mixer.name"),
    (["data=text"], "data.path"),
    (["data=text", "data.path=/nonexistent/corpus.txt"], "data.path"),
    (["data.name=nope"], "data.name"),
    (["model.d_model=0"], "model.d_model"),
    (["ckpt_path=/nonexistent.ckpt"], "ckpt_path"),
    (["optim.lr=abc"], "optim.lr"),                                # Hydra passes it as a string
    (["mixer.eta_max=lots"], "mixer.eta_max"),
    (["mixer.chunk_size=big"], "mixer.chunk_size"),
    (["trainer.val_check_interval=often"], "trainer.val_check_interval"),
])
def test_bad_values_fail_before_compute_naming_the_key(overrides, key):
    """Refused before anything is built, naming the key: by the typed schema when Hydra composes (a value
    of the wrong type for a Falcon knob, falcon_config.py) or by validate_config at start-up."""
    with pytest.raises((ConfigError, ConfigCompositionException), match=key.replace(".", r"\.")):
        validate_config(compose(overrides))


@pytest.mark.parametrize("trainer", ["gpu", "fsdp", "ddp"])
def test_gpu_trainer_without_cuda_fails_at_start_naming_the_key(trainer, tmp_path):
    """No CUDA here: a GPU trainer is refused before anything is built, naming trainer.accelerator."""
    import torch

    from falcon_lab.training import run
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal cannot happen here")
    cfg = compose([f"trainer={trainer}", "model=tiny", "logger=none", f"run_dir={tmp_path / 'r'}"])
    with pytest.raises(ValueError, match=r"trainer\.accelerator=gpu: no CUDA device"):
        run(cfg)
    assert not (tmp_path / "r").exists()


def test_config_named_callbacks_load_or_fail_naming_the_key():
    """`callbacks.<name>: module:function` (how experiment=addition adds its accuracy callback without the
    training tier importing evaluation): a target that does not load is refused at start-up by its key."""
    from falcon_lab.training.callbacks import load_callback_factory

    cfg = compose(["experiment=addition"])
    assert dict(cfg.callbacks) == {"addition_eval": "falcon_lab.evaluation.addition:callback_from_cfg"}
    validate_config(cfg)
    assert callable(load_callback_factory(cfg.callbacks.addition_eval, "addition_eval"))
    for bad in ("falcon_lab.evaluation.addition", "falcon_lab.nowhere:f", "falcon_lab.evaluation.addition:nope"):
        with pytest.raises(ConfigError, match=r"callbacks\.mine"):
            validate_config(compose([f"+callbacks.mine='{bad}'"]))
    # the sweep runner's `runner=module:function` goes through the same loader, naming its own key
    from falcon_lab.sweeps.runner import DEFAULT_RUNNER, load_runner

    assert load_runner(None) is load_runner(DEFAULT_RUNNER)
    for bad in ("falcon_lab.sweeps.runner", "falcon_lab.nowhere:f", "os:sep"):
        with pytest.raises(ConfigError, match=r"^runner: "):
            load_runner(bad)


def test_training_imports_no_tier_above_it():
    """docs/architecture.md: arrows point down. No module of falcon_lab.training imports
    falcon_lab.evaluation, .sweeps or .benchmarking (statically, at any depth of its source)."""
    import ast
    from pathlib import Path

    import falcon_lab.training as tr

    bad = []
    for f in Path(tr.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{f.name}: {n}" for n in names
                    if n.startswith(("falcon_lab.evaluation", "falcon_lab.sweeps", "falcon_lab.benchmarking"))]
    assert not bad, bad
