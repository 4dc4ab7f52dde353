#!/usr/bin/env python3
"""Reference fixtures from transformers' Qwen3.5 and Qwen3 models (dense and MoE), for Tessera's model
tests.

Builds tiny random `qwen3_5_text`, `qwen3_5_moe_text`, `qwen3` and `qwen3_moe` models in float32
with a fixed seed,
saves each as an HF checkpoint (config.json + model.safetensors), and records what the reference
implementation computes: the logits of every position of a fixed 40-token prompt, a 16-token greedy
continuation, and the per-position logits of three more prompts run one at a time (so batched
runs can be compared against sequences run alone).

Run where torch + transformers are installed (the GPU machine; it runs on the CPU in seconds):

    python3 tools/gen_hf_fixtures.py OUT_DIR [NAME ...]

Writes OUT_DIR/NAME/{config.json,model.safetensors,reference.safetensors} for each NAME of
qwen35-dense, qwen35moe, qwen3-dense, qwen3moe (all four when none is named; name only the new
ones, e.g. `python3 tools/gen_hf_fixtures.py fixtures/hf qwen3-dense qwen3moe`, to leave the
others as they are).
The reference file holds i32 token ids and f32 logits [n_tokens, n_vocab] per prompt; its
metadata records the library versions and the seed.
"""

import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

SEED = 1234
VOCAB = 512
PROMPT_LEN = 40
CONTINUE = 16
EXTRA_PROMPTS = [23, 7, 31]  # lengths of the prompts that tests batch together

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=8,  # linear, linear, linear, full, twice
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # more value heads than key heads: exercises the head map
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,  # 16 of 64 head dims rotate: 8 pairs
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
)

# Qwen3 (plain GQA attention with q/k norms, NEOX rope over the whole head): head_dim 32 is not
# hidden / heads (16), as in the real models (5120 / 64 = 80, head_dim 128).
QWEN3_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    attention_bias=False,
    use_sliding_window=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)

CONFIGS = {
    "qwen35-dense": ("qwen3_5_text", dict(intermediate_size=96)),
    "qwen35moe": (
        "qwen3_5_moe_text",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
        ),
    ),
    "qwen3-dense": ("qwen3", dict(QWEN3_COMMON, intermediate_size=96, tie_word_embeddings=False)),
    "qwen3moe": (
        "qwen3_moe",
        dict(
            QWEN3_COMMON,
            intermediate_size=96,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,  # llama.cpp's qwen3moe always renormalises (as Qwen3-30B-A3B sets)
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=True,  # the tied head, as the small Qwen3 models have
        ),
    ),
}

# Families whose RMS norms compute x * (1 + w) (Qwen3.5); the others compute x * w (Qwen3).
OFFSET_NORMS = {"qwen3_5_text", "qwen3_5_moe_text"}


def randomize(model: torch.nn.Module, gen: torch.Generator, offset_norms: bool) -> None:
    """Weights large enough that every layer matters (the default init is nearly zero). Norm weights
    scatter around 0 where the norm adds 1 itself (`offset_norms`), else around 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 8.0, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (0.0 if offset_norms else 1.0))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
            else:
                fan_in = p.shape[-1] if p.dim() >= 2 else 1
                p.copy_(torch.randn(p.shape, generator=gen) / max(fan_in, 1) ** 0.5)


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids[None, :]).logits[0].float().contiguous()


def greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(input_ids=ids[None, :], max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, ids.numel():].to(torch.int32).contiguous()


def main(out_dir: str, names: list) -> None:
    torch.set_default_dtype(torch.float32)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "seed": str(SEED)}
    print(json.dumps(versions))
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"unknown fixture(s) {unknown}; known: {list(CONFIGS)}")
    for name, (model_type, extra) in CONFIGS.items():
        if names and name not in names:
            continue
        torch.manual_seed(SEED)
        gen = torch.Generator().manual_seed(SEED)
        kwargs = extra if model_type not in OFFSET_NORMS else dict(COMMON, **extra)
        cfg = AutoConfig.for_model(model_type, **kwargs)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        randomize(model, gen, model_type in OFFSET_NORMS)
        print(name, type(model).__name__, "layer_types:", getattr(cfg, "layer_types", None))
        print(name, "params:", sum(p.numel() for p in model.parameters()))
        for pname, p in model.named_parameters():
            if ".layers.0." in pname or ".layers.3." in pname or "layers" not in pname:
                print("  ", pname, tuple(p.shape))

        dest = os.path.join(out_dir, name)
        os.makedirs(dest, exist_ok=True)
        model.save_pretrained(dest, safe_serialization=True)

        prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=gen, dtype=torch.int64)
        tensors = {
            "prompt.ids": prompt.to(torch.int32),
            "prompt.logits": logits_of(model, prompt),
        }
        cont = greedy(model, prompt, CONTINUE)
        tensors["continuation.ids"] = cont
        full = torch.cat([prompt, cont.to(torch.int64)])
        tensors["full.logits"] = logits_of(model, full)  # every position of prompt + continuation
        for i, n in enumerate(EXTRA_PROMPTS):
            ids = torch.randint(0, VOCAB, (n,), generator=gen, dtype=torch.int64)
            tensors[f"extra{i}.ids"] = ids.to(torch.int32)
            tensors[f"extra{i}.logits"] = logits_of(model, ids)
        # The greedy tokens must follow from the full-sequence logits (a self-check of the fixture).
        argmax = tensors["full.logits"][PROMPT_LEN - 1 : -1].argmax(-1).to(torch.int32)
        if not torch.equal(argmax, cont):
            print(f"WARNING {name}: greedy tokens {cont.tolist()} disagree with full-sequence argmax {argmax.tolist()}")
        save_file(tensors, os.path.join(dest, "reference.safetensors"), metadata=versions)
        lg = tensors["prompt.logits"]
        print(name, "continuation:", cont.tolist())
        print(name, "prompt logits: std %.4f, max |x| %.4f" % (lg.std().item(), lg.abs().max().item()))
        for f in sorted(os.listdir(dest)):
            print("  ", f, os.path.getsize(os.path.join(dest, f)), "bytes")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fixtures/hf", sys.argv[2:])
