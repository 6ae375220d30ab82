"""Checkpoint loading for inference and ``--start-from``: this project's and lifeiteng/vall-e's.

``load_model_checkpoint(path)`` returns ``(state_dict in this project's layout, model
hyper-parameters)``; ``get_model(hparams).load_state_dict(state)`` then rebuilds the model.

lifeiteng/vall-e checkpoints (icefall's ``save_checkpoint``: ``model`` plus the training
params at the top level) are converted:

* ``X.word_embeddings.weight`` -> ``X.weight``; the NAR audio tables (1025 rows for
  codebook 0, 1024 for the others) are stacked into one (Q, 1025, D) table whose unused
  pad rows are zero; the per-stage (1, D) stage embeddings into one (Q-1, D) table.
* fused attention ``in_proj_weight``/``in_proj_bias`` -> ``qkv_proj.weight``,
  ``q_bias``, ``v_bias`` (cross-attention: ``q_proj``, ``kv_proj``): the key bias is
  dropped, which changes nothing (softmax is invariant to it: see transformer.py).
* encoder layers' ``norm2`` (before the feed-forward) -> ``norm3``; decoder-level
  ``norm`` -> ``final_norm``; AdaLN ``project_layer`` -> ``proj``.
* hyper-parameters from the checkpoint; positions interleaved, NAR position scale fixed,
  AR head untied and the NAR heads tied lifeiteng's way (stage j -> codebook j+1's table)
  when the checkpoint's tensors are in fact tied, untied otherwise.

Plachtaa/VALL-E-X's public ``vallex-checkpoint.pt`` is lifeiteng's VALL-E plus
``{ar,nar}_language_embedding`` tables, saved as ``{"model": state_dict}`` alone: it is
recognised by those keys, its hyper-parameters are its ``macros.py`` (``VALLEX_MACROS``)
where the shapes do not tell, and its language table (``VALLEX_LANGUAGES``: the model's own
ids, en 0, zh 1, ja 2; not ``macros.lang2code``, which numbers prompt files) and text
frontend (``vallex-bpe``) are recorded in the returned hyper-parameters.

Imports torch only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from valle.args import str2bool

from .config import LEGACY_HPARAMS, TRAINING_HPARAMS, model_hparams
from .layout import NUM_AUDIO_TOKENS

LIFEITENG_HPARAM_KEYS = (
    "decoder_dim", "nhead", "num_decoder_layers", "scale_factor", "norm_first", "add_prenet",
    "prefix_mode", "share_embedding", "prepend_bos", "num_quantizers",
)  # fmt: skip
# Keys every checkpoint of ours carries in its config; without them the model would be
# built from defaults (a 1024-wide model) and fail on the first tensor.
REQUIRED_CONFIG_KEYS = ("decoder_dim", "nhead", "num_decoder_layers")


# Plachtaa/VALL-E-X's macros.py (and VALLE's defaults there): what its checkpoint leaves out.
VALLEX_MACROS: dict[str, Any] = dict(
    model_name="VALL-E", nhead=16, prefix_mode=1, norm_first=True, add_prenet=False,
)  # fmt: skip
# VALLE.language_ID of Plachtaa/VALL-E-X: row i of the language embeddings.
VALLEX_LANGUAGES = ("en", "zh", "ja")
VALLEX_FRONTEND = "vallex-bpe"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the reason."""


HUB_PREFIX = "hf:"


def resolve_checkpoint(name: str | Path) -> Path:
    """A local path, or ``hf:OWNER/REPO/FILE`` (e.g. ``hf:Plachta/VALL-E-X/vallex-checkpoint.pt``):
    that file of a Hugging Face hub repository, from the hub's cache (``HF_HUB_CACHE``), else
    downloaded into it (checked against the hub's sha256) where the network is there."""
    text = str(name)
    if not text.startswith(HUB_PREFIX):
        return Path(name)
    parts = text[len(HUB_PREFIX) :].split("/", 2)
    if len(parts) < 3 or not all(parts):
        raise CheckpointError(f"checkpoint {text}: a hub checkpoint is named hf:OWNER/REPO/FILE")
    from valle.codec.weights import HubRepoFile, one_line

    hub = HubRepoFile(f"{parts[0]}/{parts[1]}", parts[2])
    cached = hub.cached()
    if cached is not None:
        return cached
    try:
        return hub.download()
    except Exception as e:  # offline, no such repository or file, huggingface_hub missing
        raise CheckpointError(f"checkpoint {text}: {hub.missing()} ({one_line(e)})") from e


def load_payload(path: str | Path) -> dict[str, Any]:
    path = resolve_checkpoint(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        # Trainer checkpoints also carry RNG states (numpy arrays) and lifeiteng's carry
        # Paths, which the safe unpickler refuses; only load checkpoints you trust.
        try:
            payload = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:
            raise CheckpointError(f"checkpoint {path}: unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(payload, Mapping) or "model" not in payload:
        raise CheckpointError(f"checkpoint {path}: not a model checkpoint (no 'model' entry)")
    return dict(payload)


def is_lifeiteng_state(state: Mapping[str, Any]) -> bool:
    return any(k.endswith("word_embeddings.weight") or ".in_proj_weight" in k for k in state)


def is_vallex_state(state: Mapping[str, Any]) -> bool:
    """Plachtaa/VALL-E-X's layout: lifeiteng's keys plus its language embeddings."""
    return "ar_language_embedding.word_embeddings.weight" in state


def load_model_checkpoint(
    path: str | Path, *, use_averaged_model: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict in this project's layout, model hyper-parameters) from ``path``.

    Accepts this project's checkpoints (``valle-checkpoint-1``) and lifeiteng/vall-e's.
    ``use_averaged_model`` takes ``model_avg`` instead of ``model``. Raises
    ``CheckpointError`` (a ValueError) with the file named when it cannot.
    ``get_model(hparams)`` builds the model (extra keys such as ``text_tokens`` and
    ``source_format`` are ignored by it).
    """
    return from_payload(load_payload(path), str(path), use_averaged_model=use_averaged_model)


def from_payload(
    payload: Mapping[str, Any], name: str, *, use_averaged_model: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``load_model_checkpoint`` on an already loaded payload (``name`` is for messages)."""
    key = "model_avg" if use_averaged_model else "model"
    state = payload.get(key)
    if state is None:
        raise CheckpointError(f"checkpoint {name}: holds no {key!r} (averaged model)")
    # Tolerate wrappers' prefixes (DDP "module.", torch.compile "_orig_mod.").
    state = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in state.items()}
    if is_lifeiteng_state(state):
        return convert_lifeiteng(state, payload, name=name)
    config = payload.get("config")
    if not isinstance(config, Mapping):
        raise CheckpointError(
            f"checkpoint {name}: no 'config' with the model's hyper-parameters (not written "
            "by bin/trainer.py, nor a lifeiteng/vall-e checkpoint)"
        )
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in config]
    if missing:
        raise CheckpointError(f"checkpoint {name}: its config lacks {', '.join(missing)}")
    try:
        return state, ours_hparams(config, state)
    except ValueError as e:  # a removed option, or a value no longer accepted
        raise CheckpointError(f"checkpoint {name}: {e}") from e


def ours_hparams(config: Mapping[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """Hyper-parameters of one of our checkpoints, old ones (before the keys existed) included."""
    config = dict(config)
    for k, v in LEGACY_HPARAMS.items():
        config.setdefault(k, v)
    if "tie_ar_head" not in config:
        # The first model tied the AR head exactly when --share-embedding was true.
        config["tie_ar_head"] = "ar_predict_layer.weight" not in state
    # Loss settings stay with whoever trains next (the flags), defaults elsewhere.
    return {k: v for k, v in model_hparams(config).items() if k not in TRAINING_HPARAMS}


# ------------------------------------------------------------------ lifeiteng
_RENAMES = [
    (re.compile(r"^(ar|nar)_decoder\.norm\.project_layer\."), r"\1_decoder.final_norm.proj."),
    (re.compile(r"^(ar|nar)_decoder\.norm\."), r"\1_decoder.final_norm."),
    (re.compile(r"\.project_layer\."), ".proj."),
    (re.compile(r"\.multihead_attn\."), ".cross_attn."),
    (re.compile(r"^(ar_text_embedding|nar_text_embedding|ar_audio_embedding|ar_language_embedding"
                r"|nar_language_embedding)\.word_embeddings\."), r"\1."),
]  # fmt: skip


def convert_lifeiteng(
    state: Mapping[str, torch.Tensor], params: Mapping[str, Any], name: str = "checkpoint"
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """lifeiteng/vall-e ``model`` state dict + its params -> (our state dict, our hparams)."""
    state = {k: v.detach().float() for k, v in state.items()}
    hp = _lifeiteng_hparams(state, params, name)
    cross = hp["model_name"] == "vallf"
    q, out = hp["num_quantizers"], {}
    for k, v in state.items():
        if k.startswith(("nar_audio_embeddings.", "nar_stage_embeddings.", "nar_predict_layers.")):
            continue  # stacked below
        if k.endswith("_accuracy_metric") or "accuracy_metric." in k:
            continue
        m = re.match(
            r"^(ar|nar)_decoder\.layers\.(\d+)\.(self_attn|multihead_attn)\.in_proj_(weight|bias)$",
            k,
        )
        if m:
            out.update(_split_in_proj(k, v, m.group(3) == "multihead_attn"))
            continue
        new = k
        for pattern, repl in _RENAMES:
            new = pattern.sub(repl, new)
        if not cross:  # encoder layers: norm2 is the feed-forward's norm, ours is norm3
            new = re.sub(r"^((ar|nar)_decoder\.layers\.\d+)\.norm2\.", r"\1.norm3.", new)
        out[new] = v
    if q > 1:
        d = state["nar_audio_embeddings.0.word_embeddings.weight"].shape[1]
        table = torch.zeros(q, NUM_AUDIO_TOKENS + 1, d)
        for k in range(q):
            w = state[f"nar_audio_embeddings.{k}.word_embeddings.weight"]
            table[k, : w.shape[0]] = w
        out["nar_audio_embedding"] = table
        out["nar_stage_embedding.weight"] = torch.cat(
            [state[f"nar_stage_embeddings.{j}.word_embeddings.weight"] for j in range(q - 1)]
        )
        heads = [state[f"nar_predict_layers.{j}.weight"] for j in range(q - 1)]
        if hp["share_embedding"]:
            out["nar_predict_last"] = heads[-1]
        else:
            out["nar_predict_weight"] = torch.stack(heads)
    return out, hp


def _split_in_proj(key: str, v: torch.Tensor, cross: bool) -> dict[str, torch.Tensor]:
    """Fused [q; k; v] projection -> ours (no key bias: softmax is invariant to it)."""
    base = key.rsplit(".", 1)[0]
    base = base.replace(".multihead_attn", ".cross_attn")
    d = v.shape[0] // 3
    if key.endswith("weight"):
        if cross:
            return {f"{base}.q_proj.weight": v[:d], f"{base}.kv_proj.weight": v[d:]}
        return {f"{base}.qkv_proj.weight": v}
    q_bias, v_bias = v[:d], v[2 * d :]
    if cross:
        return {f"{base}.q_proj.bias": q_bias, f"{base}.v_bias": v_bias}
    return {f"{base}.q_bias": q_bias, f"{base}.v_bias": v_bias}


def vallex_params(state: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, Any]:
    """lifeiteng's hyper-parameters of a Plachtaa/VALL-E-X state dict: read from its shapes
    where they tell (width, layers, NAR scale, codebooks, BOS row, languages), its macros
    otherwise; a value the file does carry at the top level wins."""
    d = int(state["ar_text_embedding.word_embeddings.weight"].shape[1])
    layers = {int(m.group(1)) for k in state if (m := re.match(r"^ar_decoder\.layers\.(\d+)\.", k))}
    nar_d = d
    if "nar_text_embedding.word_embeddings.weight" in state:
        nar_d = int(state["nar_text_embedding.word_embeddings.weight"].shape[1])
    q = 1 + len({k.split(".")[1] for k in state if k.startswith("nar_predict_layers.")})
    out = dict(VALLEX_MACROS)
    out.update(
        decoder_dim=d, num_decoder_layers=len(layers), scale_factor=nar_d / d, num_quantizers=q,
        # 1024 codes + EOS (+ BOS): the audio table's rows say whether BOS is prepended
        prepend_bos=int(state["ar_audio_embedding.word_embeddings.weight"].shape[0])
        > NUM_AUDIO_TOKENS + 1,
        # lifeiteng's share_embedding; _lifeiteng_hparams checks the tensors are in fact tied
        share_embedding=True,
        add_prenet=any(k.startswith("ar_text_prenet.") for k in state),
    )  # fmt: skip
    out.update({k: params[k] for k in LIFEITENG_HPARAM_KEYS if k in params})
    return out


def vallex_languages(state: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> list[str]:
    """The language of each row of a VALL-E X checkpoint's language table: its own
    (``languages`` at the top level, written when a language was added) or Plachtaa's."""
    rows = int(state["ar_language_embedding.word_embeddings.weight"].shape[0])
    languages = list(params.get("languages") or VALLEX_LANGUAGES)
    if len(languages) < rows:
        raise CheckpointError(
            f"a VALL-E X checkpoint with {rows} language rows names only {languages}: record "
            "its languages (a 'languages' list at the top level, in row order)"
        )
    return languages[:rows]


def _lifeiteng_hparams(state, params: Mapping[str, Any], name: str) -> dict[str, Any]:
    vallex = is_vallex_state(state)
    if vallex:
        params = {**params, **vallex_params(state, params)}
    missing = [k for k in LIFEITENG_HPARAM_KEYS if k not in params]
    if missing:
        raise CheckpointError(
            f"{name}: a lifeiteng/vall-e checkpoint without its hyper-parameters "
            f"({', '.join(missing)} missing at the top level)"
        )
    if str2bool(params["add_prenet"]):
        raise CheckpointError(
            f"{name}: lifeiteng --add-prenet true checkpoints are not supported (its prenets use "
            "BatchNorm, ours LayerNorm: the weights do not carry over)"
        )
    hp = {k: params[k] for k in LIFEITENG_HPARAM_KEYS}
    model_name = str(params.get("model_name", "VALL-E")).lower()
    if model_name not in ("vall-e", "valle", "vall-f", "vallf"):
        raise CheckpointError(f"{name}: lifeiteng model {model_name!r} is not VALL-E/VALL-F")
    hp["model_name"] = "vallf" if model_name in ("vall-f", "vallf") else "valle"
    hp["num_text_tokens"] = int(state["ar_text_embedding.word_embeddings.weight"].shape[0])
    hp.update(tie_ar_head=False, positions="interleaved", nar_position_scale="fixed",
              nar_head_tie="lifeiteng", dropout=0.1)  # fmt: skip
    q = int(hp["num_quantizers"])
    if str2bool(hp["share_embedding"]) and q > 1:
        # Tied as lifeiteng ties them? (stage j's head is codebook j+1's table.)
        tied = all(
            torch.equal(state[f"nar_predict_layers.{j}.weight"],
                        state[f"nar_audio_embeddings.{j + 2}.word_embeddings.weight"])
            for j in range(q - 2)
        )  # fmt: skip
        hp["share_embedding"] = tied
    if "text_tokens" in params:
        hp["text_tokens"] = str(params["text_tokens"])
    if vallex:
        try:
            hp["languages"] = vallex_languages(state, params)
        except CheckpointError as e:
            raise CheckpointError(f"{name}: {e}") from e
        hp["num_languages"] = len(hp["languages"])
    out = model_hparams(hp)
    if "text_tokens" in hp:
        out["text_tokens"] = hp["text_tokens"]
    out["source_format"] = "lifeiteng"
    if vallex:
        # Users name languages (this table), never ids; the text frontend is Plachtaa's.
        out.update(source_format="vallex", languages=hp["languages"],
                   text_frontend=str(params.get("text_frontend", VALLEX_FRONTEND)))
    return out

