"""Get a model onto disk (built locally or downloaded), load it, and find a run's snapshots of it.

torch is imported where it is used, so the launcher can name the snapshot folder for free.

Every rank loads the same saved weights, so parallel runs start from exactly the reference's
initial parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardlab.errors import load_artifact


SNAPSHOTS = "model-steps"  # a run's model snapshots during training (training.save_model_every)
# A model built for a fitted tokenizer gets embedding rows for a multiple of this many tokens, as Megatron
# pads (make-vocab-size-divisible-by 128; Pythia's 50,277 tokens have 50,304 rows): the vocabulary then
# splits evenly over any tensor-parallel degree up to 128. The extra rows are never a target.
VOCAB_MULTIPLE = 128


def snapshot_dir(run: Path | str, steps_done: int) -> Path:
    """Where a run's model after `steps_done` optimizer steps is saved, beside its final `model/`."""
    return Path(run) / SNAPSHOTS / f"step-{steps_done:06d}"


def padded_vocab_size(tokens: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Embedding rows for a tokenizer of `tokens` tokens: the next multiple of `multiple`."""
    return -(-tokens // multiple) * multiple


def snapshots(run: Path | str) -> dict[int, Path]:
    """{steps done: model folder} of a run's saved snapshots, in step order."""
    found = sorted(Path(run).glob(f"{SNAPSHOTS}/step-*/config.json"))
    return {int(path.parent.name.removeprefix("step-")): path.parent for path in found}


class ModelUnavailable(RuntimeError):
    """The hub model cannot be fetched; the message says how to fix it."""


def tiny_neox_config(model_cfg: dict):
    """A GPT-NeoX (Pythia architecture) config for a model built from scratch; dropout off."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=model_cfg["vocab_size"],
        hidden_size=model_cfg["hidden_size"],
        num_hidden_layers=model_cfg["num_layers"],
        num_attention_heads=model_cfg["num_heads"],
        intermediate_size=model_cfg["intermediate_size"],
        max_position_embeddings=model_cfg.get("max_position_embeddings", 2048),
        rotary_pct=model_cfg.get("rotary_pct", 0.25),
        use_parallel_residual=True,  # as in Pythia
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )


def build_local_model(model_cfg: dict, out_dir: Path) -> None:
    import torch
    from transformers import GPTNeoXForCausalLM

    torch.manual_seed(model_cfg.get("seed", 0))
    model = GPTNeoXForCausalLM(tiny_neox_config(model_cfg))
    model.save_pretrained(out_dir)


def download_hub_model(model_cfg: dict, out_dir: Path) -> None:
    from huggingface_hub import snapshot_download

    hub_id = model_cfg["hub_id"]
    try:
        snapshot_download(repo_id=hub_id, revision=model_cfg.get("revision"), local_dir=out_dir,
                          allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    except Exception as err:  # the hub raises many types (connection, offline mode, gated repo)
        raise ModelUnavailable(
            f"could not download '{hub_id}' from the Hugging Face hub ({type(err).__name__}: {err}).\n"
            f"  Fix one of: run with network access (and HF_TOKEN for gated models); or download it elsewhere\n"
            f"  with `huggingface-cli download {hub_id} --local-dir {out_dir}` and copy that folder here;\n"
            f"  or use a locally built model (model.source: local)."
        ) from None


def prepare_model(model_cfg: dict, out_dir: Path | str) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if model_cfg["source"] == "local":
        build_local_model(model_cfg, out_dir)
    else:
        download_hub_model(model_cfg, out_dir)
    record = dict(model_cfg, shape=architecture(out_dir / "config.json"))
    (out_dir / "shardlab_model.json").write_text(json.dumps(record, indent=2, sort_keys=True))
    return out_dir


def architecture(config_json: Path) -> dict:
    """The sizes every cost model needs, from a Hugging Face GPT-NeoX config.json (local or hub), so
    the record `shardlab_model.json` beside the weights describes the model without loading it."""
    config = json.loads(Path(config_json).read_text())
    return {"vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"],
            "num_layers": config["num_hidden_layers"], "num_heads": config["num_attention_heads"],
            "intermediate_size": config["intermediate_size"]}


def load_model(model_dir: Path | str):
    """Load in fp32 (mixed precision, when asked for, is autocast on top of fp32 master weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = load_artifact("model", model_dir, lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    model.config.use_cache = False
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
