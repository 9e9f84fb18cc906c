"""Hugging Face architectures with features the GPT models of the other tests lack, sharded as users shard them
(every block, then the root) and trained as the unsharded model trains them:

- T5: one embedding shared by the encoder, the decoder and the LM head, encoder and decoder blocks in their own
  groups, cross-attention reading the encoder's output;
- Mixtral: a sparse mixture of experts whose experts are 3-D parameters (sharded on the expert dim, two experts
  per rank at 2 ranks) and whose top-1 router leaves experts without tokens on some ranks and steps;
- wav2vec2: a convolutional feature encoder and a weight-normalised grouped convolution
  (``torch.nn.utils.parametrizations.weight_norm``, its parameters under ``parametrizations.weight``) before the
  encoder blocks, trained on a CTC loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from fullshard import fully_shard
from tests.harness import run_ranks
from tests.parity import run_parity

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")

Batch = dict[str, torch.Tensor]
Case = tuple[Callable[[], nn.Module], list[str], Callable[[torch.Generator], Batch]]  # build, the block lists to shard, a batch


def _t5() -> Case:
    config = transformers.T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, dropout_rate=0.0, tie_word_embeddings=True, decoder_start_token_id=0,
                                   pad_token_id=0)

    def batch(gen: torch.Generator) -> Batch:
        return {"input_ids": torch.randint(1, 40, (2, 7), generator=gen),
                "labels": torch.randint(1, 40, (2, 5), generator=gen)}

    return lambda: transformers.T5ForConditionalGeneration(config), ["encoder.block", "decoder.block"], batch


def _mixtral() -> Case:
    config = transformers.MixtralConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=2, num_local_experts=4,
                                        num_experts_per_tok=1, max_position_embeddings=16)

    def batch(gen: torch.Generator) -> Batch:
        ids = torch.randint(0, 40, (1, 5), generator=gen)
        return {"input_ids": ids, "labels": ids}

    return lambda: transformers.MixtralForCausalLM(config), ["model.layers"], batch


def _wav2vec2() -> Case:
    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0)

    def batch(gen: torch.Generator) -> Batch:
        return {"input_values": torch.randn(2, 300, generator=gen),
                "labels": torch.randint(1, 12, (2, 4), generator=gen)}

    return lambda: transformers.Wav2Vec2ForCTC(config), ["wav2vec2.encoder.layers"], batch


MODELS: dict[str, Callable[[], Case]] = {
    "t5": _t5, "mixtral": _mixtral, "wav2vec2": _wav2vec2,
}


def _trains_as_unsharded(rank: int, world_size: int, name: str) -> None:
    build, block_lists, batch = MODELS[name]()

    def shard(model: nn.Module) -> None:
        for path in block_lists:
            for block in model.get_submodule(path).children():
                fully_shard(block)
        fully_shard(model)

    def loss(model: nn.Module, b: Any) -> torch.Tensor:
        return model(**b).loss

    _, model = run_parity(rank, world_size, build, shard, batch, loss, steps=3, rtol=1e-4, atol=1e-5)
    if name == "t5":  # the tie survives sharding: one parameter, reachable under all four names
        tied = {id(model.get_parameter(f"{m}.weight")) for m in ("shared", "encoder.embed_tokens",
                                                                 "decoder.embed_tokens", "lm_head")}
        assert len(tied) == 1
    if name == "wav2vec2":
        conv = model.get_submodule("wav2vec2.encoder.pos_conv_embed.conv")
        assert {n for n, _ in conv.named_parameters()} == {"bias", "parametrizations.weight.original0",
                                                          "parametrizations.weight.original1"}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_trains_as_the_unsharded_model(name: str) -> None:
    run_ranks(2, _trains_as_unsharded, name)
