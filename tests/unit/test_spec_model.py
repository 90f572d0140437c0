"""The job spec's model section: ``model.hf`` folders, ``model.kind``, and ``checkpoint.export``.

The service reads a Hugging Face folder's config.json (stdlib only, never torch) to validate and
plan a job; these tests write real config.json files the way transformers does (the keys of
``LlamaConfig.to_dict()``), without weights: the service never reads the weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from etrain.service.access.storage_roots import StorageRoots
from etrain.service.planning.spec import JobSpec
from etrain.service.planning.spec_checks import check_spec
from etrain.service.planning.spec_paths import pin_paths, resolve_paths
from etrain.workers.checkpoints.hf_config import DEFAULT_MAX_SEQ_LEN
from etrain.workers.protocol.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write_config(folder: Path, **overrides) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    config.update(overrides)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def spec(model: dict, **sections) -> JobSpec:
    body = {
        "name": "hf",
        "model": model,
        "training": {"steps": 4, "global_batch": 4, "micro_batch": 1},
        "parallelism": {"dp": 2},
    }
    body.update(sections)
    return JobSpec.model_validate(body)


def fields(problems) -> dict[str, str]:
    return {p.field: p.message for p in problems}


class TestKind:
    @pytest.mark.parametrize(
        ("model", "kind"),
        [
            ({"preset": "gpt-tiny"}, "gpt"),
            ({"preset": "llama-tiny"}, "llama"),
            ({"preset": "olmo2-tiny"}, "olmo2"),
            ({"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, "seq_len": 16}, "gpt"),
        ],
    )
    def test_kind_defaults_to_what_the_model_is_and_is_stored(self, model, kind):
        parsed = spec(model)
        assert parsed.model.kind == kind
        assert parsed.model_dump(mode="json", by_alias=True)["model"]["kind"] == kind
        assert JobSpec.model_validate(parsed.model_dump(mode="json", by_alias=True)) == parsed  # round trip

    @pytest.mark.parametrize(
        ("architecture", "kind"),
        [("LlamaForCausalLM", "llama"), ("Qwen3ForCausalLM", "llama"), ("Olmo2ForCausalLM", "olmo2")],
    )
    def test_with_hf_the_kind_is_the_folders_family_pinned_with_the_paths(self, tmp_path, architecture, kind):
        write_config(tmp_path / "m", architectures=[architecture])
        parsed = spec({"hf": "m"})
        assert parsed.model.kind is None  # unknown until the folder is read
        pinned, outside = pin_paths(parsed, tmp_path, StorageRoots.of([tmp_path]))
        assert outside == [] and pinned.model.kind == kind
        assert pinned.model_dump(mode="json", by_alias=True)["model"]["kind"] == kind
        assert check_spec(pinned) == [] and pinned.to_run_config(job_id="j", checkpoint_root="/c").model.arch == kind
        # a folder outside the roots is never read; one that cannot be read is check_spec's to name
        assert pin_paths(parsed, tmp_path, StorageRoots.of([tmp_path / "elsewhere"]))[0].model.kind is None
        assert pin_paths(spec({"hf": "nope"}), tmp_path, StorageRoots.of([tmp_path]))[0].model.kind is None
        other = "gpt" if kind != "gpt" else "llama"
        wrong = resolve_paths(spec({"hf": "m", "kind": other}), tmp_path)
        assert fields(check_spec(wrong))["model.kind"] == (
            f"model.kind={other!r} but model.hf holds a {architecture} (model.kind={kind!r})."
        )

    def test_explicit_llama_sizes_build_a_llama_with_grouped_query_attention(self):
        parsed = spec(
            {
                "kind": "llama",
                "n_layers": 2,
                "d_model": 32,
                "n_heads": 4,
                "n_kv_heads": 2,
                "vocab_size": 64,
                "seq_len": 16,
            }
        )
        assert check_spec(parsed) == []
        config = parsed.model.to_config()
        assert (config.arch, config.kv_heads, config.hf_path) == ("llama", 2, None)

    @pytest.mark.parametrize(
        ("model", "field", "words"),
        [
            ({"preset": "llama-tiny", "kind": "gpt"}, "model.kind", "is a llama model"),
            ({"preset": "gpt-tiny", "kind": "llama"}, "model.kind", "is a gpt model"),
            ({"preset": "gpt-tiny", "n_kv_heads": 2}, "model.n_kv_heads", "does not apply to model.kind='gpt'"),
            ({"preset": "olmo2-tiny", "kind": "llama"}, "model.kind", "is a olmo2 model"),
        ],
    )
    def test_conflicting_kinds_are_problems(self, model, field, words):
        assert words in fields(check_spec(spec(model)))[field]

    def test_an_unregistered_kind_is_refused_naming_the_registered_families(self):
        """The run config names a family without asking the registry: the spec asks it. Pydantic refuses the
        name at parse (and check_spec on a spec changed after it); a spec built past pydantic meets the
        registry's ConfigError in ``to_config``, which check_spec reports as a problem of ``model.kind``."""
        sizes = {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, "seq_len": 16}
        with pytest.raises(ValidationError, match="model.kind"):
            spec({"kind": "mamba", **sizes})
        parsed = spec({"kind": "llama", **sizes})
        changed = parsed.model_copy(update={"model": parsed.model.model_copy(update={"kind": "mamba"})})
        assert "'gpt', 'llama', 'olmo2', 'qwen3_moe' or 'mixtral'" in fields(check_spec(changed))["model.kind"]
        with pytest.raises(ConfigError) as info:
            changed.model.to_config()
        assert info.value.field == "model.kind" and "gpt, llama, olmo2, qwen3_moe, mixtral" in info.value.fix


class TestHfFolder:
    def test_sizes_and_path_come_from_the_folder(self, tmp_path):
        write_config(tmp_path / "models" / "tiny")
        resolved = resolve_paths(spec({"hf": "models/tiny", "seq_len": 32}), tmp_path)
        assert resolved.model.hf == str(tmp_path / "models" / "tiny")  # pinned like data.path
        assert check_spec(resolved) == []
        config = resolved.to_run_config(job_id="j", checkpoint_root="/ckpt").model
        assert (config.arch, config.n_layers, config.d_model, config.n_heads, config.kv_heads) == ("llama", 2, 64, 4, 2)
        assert (config.ffn_dim, config.vocab_size, config.seq_len) == (176, 256, 32)
        assert (config.hf_path, config.hf_architecture) == (str(tmp_path / "models" / "tiny"), "LlamaForCausalLM")
        assert resolved.model.resolved()["vocab_size"] == 256

    @pytest.mark.parametrize(("max_positions", "expected"), [(8192, DEFAULT_MAX_SEQ_LEN), (512, 512)])
    def test_seq_len_defaults_to_the_context_capped_at_4096(self, tmp_path, max_positions, expected):
        write_config(tmp_path / "m", max_position_embeddings=max_positions)
        assert spec({"hf": str(tmp_path / "m")}).model.to_config().seq_len == expected == min(max_positions, 4096)

    def test_an_unsupported_architecture_names_model_hf_and_the_supported_ones(self, tmp_path):
        write_config(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
        [problem] = check_spec(spec({"hf": str(tmp_path / "gpt2")}))
        assert problem.field == "model.hf"
        assert problem.message == "model.hf architecture GPT2LMHeadModel is not supported."
        assert problem.fix == (
            "use a model of one of the supported architectures: LlamaForCausalLM, MistralForCausalLM, "
            "MixtralForCausalLM, Olmo2ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"
        )

    def test_preset_and_sizes_are_exclusive_with_hf_but_seq_len_is_not(self, tmp_path):
        write_config(tmp_path / "m")
        problems = check_spec(
            spec({"hf": str(tmp_path / "m"), "preset": "llama-tiny", "n_layers": 8, "vocab_size": 300, "seq_len": 64})
        )
        assert sorted(fields(problems)) == ["model.n_layers", "model.preset", "model.vocab_size"]
        assert fields(problems)["model.preset"].startswith("model.hf and model.preset are exclusive")

    def test_a_missing_folder_and_a_too_long_context_are_named(self, tmp_path):
        assert "is not a folder" in fields(check_spec(spec({"hf": str(tmp_path / "nope")})))["model.hf"]
        write_config(tmp_path / "m", max_position_embeddings=128)
        assert (
            "max_position_embeddings=128"
            in fields(check_spec(spec({"hf": str(tmp_path / "m"), "seq_len": 129})))["model.seq_len"]
        )

    def test_model_problems_do_not_hide_the_other_rules(self, tmp_path):
        problems = check_spec(
            spec({"hf": str(tmp_path / "nope")}, training={"steps": 4, "global_batch": 5, "micro_batch": 1})
        )
        assert sorted(fields(problems)) == ["model.hf", "training.global_batch"]


class TestExport:
    def test_export_defaults_to_hf_for_hf_models_only(self, tmp_path):
        write_config(tmp_path / "m")
        assert spec({"hf": str(tmp_path / "m")}).export_format == "hf"
        assert spec({"hf": str(tmp_path / "m")}, checkpoint={"export": "none"}).export_format == "none"
        assert spec({"preset": "llama-tiny"}).export_format == "none"
        assert spec({"preset": "llama-tiny"}, checkpoint={"export": "hf"}).export_format == "hf"
        assert check_spec(spec({"preset": "llama-tiny"}, checkpoint={"export": "hf"})) == []
        assert check_spec(spec({"preset": "olmo2-tiny"}, checkpoint={"export": "hf"})) == []

    def test_a_gpt_cannot_export_to_hugging_face_format(self):
        problems = check_spec(spec({"preset": "gpt-tiny"}, checkpoint={"export": "hf"}))
        assert list(fields(problems)) == ["checkpoint.export"]


def test_reading_a_hf_spec_never_imports_torch(tmp_path):
    write_config(tmp_path / "m")
    code = (
        "import sys, json\n"
        "from etrain.service.planning.spec import JobSpec\nfrom etrain.service.planning.spec_checks import check_spec\n"
        "from etrain.service.decisions import supervisor\n"
        "from etrain.service.store import job_store\n"
        "from etrain.service import manager\n"
        f"s = JobSpec.model_validate({{'name': 'x', 'model': {{'hf': {str(tmp_path / 'm')!r}}},"
        " 'training': {'steps': 1, 'global_batch': 2}})\n"
        "assert check_spec(s) == [], check_spec(s)\n"
        "s.to_run_config(job_id='j', checkpoint_root='/c')\n"
        "assert 'torch' not in sys.modules, 'the service imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_checkpoint_async_defaults_on_for_cuda_and_off_for_cpu_and_is_a_switch():
    tiny = {"preset": "gpt-tiny"}

    def config(**sections):
        return spec(tiny, **sections).to_run_config(job_id="j", checkpoint_root="/c").checkpoint

    assert config().async_save is False
    assert config(resources={"device": "cuda", "gpus_per_worker": 1}).async_save is True
    assert config(resources={"device": "cuda", "gpus_per_worker": 1}, checkpoint={"async": False}).async_save is False
    assert config(checkpoint={"async": True}).async_save is True


def test_checkpoint_every_steps_auto_and_the_mtbf_reach_the_ranks():
    auto = spec({"preset": "gpt-tiny"}, checkpoint={"every_steps": "auto"}, fault_tolerance={"mtbf_hours": 6})
    checkpoint = auto.to_run_config(job_id="j", checkpoint_root="/c").checkpoint
    assert (checkpoint.every_steps, checkpoint.auto_interval, checkpoint.mtbf_hours) == (0, True, 6.0)
    fixed = spec({"preset": "gpt-tiny"}, checkpoint={"every_steps": 20}).to_run_config(job_id="j", checkpoint_root="/c")
    assert (fixed.checkpoint.every_steps, fixed.checkpoint.auto_interval, fixed.checkpoint.mtbf_hours) == (
        20,
        False,
        24.0,
    )
    for bad in ({"checkpoint": {"every_steps": "sometimes"}}, {"fault_tolerance": {"mtbf_hours": 0}}):
        with pytest.raises(ValueError):
            spec({"preset": "gpt-tiny"}, **bad)
