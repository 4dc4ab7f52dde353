"""Reference logits of a 150-token sequence for the two HF fixtures (fixtures/hf/*), from
transformers in float32: a sequence long enough that a one-pass prefill crosses the 64-token
chunks of the chunked gated delta rule twice (Tessera chunks at 64). Only every 7th row and the
last 3 rows are kept, to stay small. Run from the repository root on a machine with torch +
transformers (generated on the lent GPU machine's CPU):

    python3 models/tests/data/gen_hf_long.py models/tests/data
"""

import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

SEED = 4321
N = 150
VOCAB = 512


def main(out_dir: str) -> None:
    torch.set_default_dtype(torch.float32)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "seed": str(SEED)}
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, VOCAB, (N,), generator=gen, dtype=torch.int64)
    rows = torch.tensor(sorted(set(range(0, N, 7)) | {N - 3, N - 2, N - 1}), dtype=torch.int64)
    for name in ["qwen35-dense", "qwen35moe"]:
        model = AutoModelForCausalLM.from_pretrained(os.path.join("fixtures/hf", name), dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0].float()
        out = {
            "ids": ids.to(torch.int32).contiguous(),
            "rows": rows.to(torch.int32).contiguous(),
            "logits": logits[rows].contiguous(),
        }
        path = os.path.join(out_dir, f"hf_long_{name}.safetensors")
        save_file(out, path, metadata=meta)
        print(name, path, tuple(out["logits"].shape), "std %.4f" % logits.std().item(), meta)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
