"""A small multimodal projector (``mmproj``) GGUF to go with a synthetic text model."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGUFWriter


def write_projector(path: os.PathLike | str, text_embd: int, *, embd: int = 32, ff: int = 64, heads: int = 2,
                    layers: int = 2, image_size: int = 28, patch_size: int = 14, hidden: int = 64,
                    seed: int = 0) -> Path:
    """A small multimodal projector (``mmproj``) that llama.cpp's multimodal loader accepts: a
    LLaVA-style vision tower (``clip``, projector type ``mlp``) of ``layers`` blocks over
    ``image_size`` pixels in ``patch_size`` patches, and a two-layer MLP into the text model's
    ``text_embd``. Its weights are random: it turns an image into ``(image_size / patch_size)**2``
    embeddings of the right shape, which is what loading, memory and offload need.
    """
    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
    if embd % heads:
        raise ValueError(f"embd {embd} is not a multiple of heads {heads}")
    rng = np.random.default_rng(seed)

    def r(*shape) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    path = Path(path)
    w = GGUFWriter(str(path), "clip")
    w.add_string("general.name", "synthetic projector")
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.embedding_length", embd)
    w.add_uint32("clip.vision.feed_forward_length", ff)
    w.add_uint32("clip.vision.block_count", layers)
    w.add_uint32("clip.vision.projection_dim", text_embd)
    w.add_uint32("clip.vision.attention.head_count", heads)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", patch_size)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_tensor("v.patch_embd.weight", r(embd, 3, patch_size, patch_size).astype(np.float16))
    w.add_tensor("v.position_embd.weight", r((image_size // patch_size) ** 2, embd))
    for il in range(layers):
        for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"v.blk.{il}.{t}.weight", r(embd, embd))
            w.add_tensor(f"v.blk.{il}.{t}.bias", r(embd))
        for t in ("ln1", "ln2"):
            w.add_tensor(f"v.blk.{il}.{t}.weight", np.ones(embd, np.float32))
            w.add_tensor(f"v.blk.{il}.{t}.bias", np.zeros(embd, np.float32))
        w.add_tensor(f"v.blk.{il}.ffn_up.weight", r(ff, embd))
        w.add_tensor(f"v.blk.{il}.ffn_up.bias", r(ff))
        w.add_tensor(f"v.blk.{il}.ffn_down.weight", r(embd, ff))
        w.add_tensor(f"v.blk.{il}.ffn_down.bias", r(embd))
    w.add_tensor("mm.0.weight", r(hidden, embd))
    w.add_tensor("mm.0.bias", r(hidden))
    w.add_tensor("mm.2.weight", r(text_embd, hidden))
    w.add_tensor("mm.2.bias", r(text_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
