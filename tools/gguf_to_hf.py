"""A GGUF checkpoint as a Hugging Face directory (config.json, tokenizer files, generation_config.json,
model.safetensors in bf16), for engines that load HF directories (vLLM, sglang) on a machine with no hub.

    python -m kvbench.tools.gguf_to_hf MODEL.gguf OUT_DIR [--dtype bfloat16] [--check]

The weights are dequantized by transformers' GGUF loader (needs the ``gguf`` package); the state dict is
saved directly (transformers refuses ``save_pretrained`` on a GGUF-loaded model).  Chat models whose
template ends turns with a token other than the GGUF's EOS (SmolLM2: ``<|im_end|>``) get that token added
to ``generation_config.eos_token_id``, so a server stops where the embedded engine does.  ``--check``
reloads the directory and compares its logits on a prompt with the GGUF-loaded model's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def convert(gguf: Path, out: Path, dtype: str = "bfloat16") -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    torch_dtype = getattr(torch, dtype)
    out.mkdir(parents=True, exist_ok=True)
    src, name = str(gguf.resolve().parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch_dtype)
    tok.save_pretrained(out)
    config = model.config
    config.architectures = [type(model).__name__]  # engines pick their model class from this
    if hasattr(config, "quantization_config"):  # the weights are saved dequantized: no GGUF quantization left
        del config.quantization_config
    config.save_pretrained(out)
    gen = model.generation_config
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id] if gen.eos_token_id is not None else []
    end_of_turn = _end_of_turn_token(tok)
    if end_of_turn is not None and end_of_turn not in eos:
        eos = [end_of_turn, *eos]
    gen.eos_token_id = eos[0] if len(eos) == 1 else eos
    if tok.pad_token_id is None and end_of_turn is not None:
        gen.pad_token_id = end_of_turn
    gen.save_pretrained(out)
    state = {k: v.detach().to(torch_dtype).contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    info = {"gguf": str(gguf), "out": str(out), "tensors": len(state), "params": sum(v.numel() for v in state.values()),
            "dtype": dtype, "eos_token_id": gen.eos_token_id, "architecture": (model.config.architectures or ["?"])[0],
            "seconds": round(time.time() - t0, 1)}
    (out / "kvbench_conversion.json").write_text(json.dumps(info, indent=1))
    return info


def _end_of_turn_token(tok):
    """The token a chat template closes an assistant turn with (``<|im_end|>``, ``<|eot_id|>``, ...), if any."""
    template = getattr(tok, "chat_template", None) or ""
    for cand in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        if cand in template:
            tid = tok.convert_tokens_to_ids(cand)
            if isinstance(tid, int) and tid != tok.unk_token_id:
                return tid
    return None


def check(gguf: Path, out: Path, prompt: str = "The capital of France is Paris. The capital of Italy is") -> float:
    """Largest |logit difference| on ``prompt`` between the GGUF-loaded model and the converted directory
    (both float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(prompt, return_tensors="pt").input_ids
    a = AutoModelForCausalLM.from_pretrained(str(gguf.resolve().parent), gguf_file=gguf.name, dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    return float((la - lb).abs().max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gguf_to_hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--check", action="store_true", help="compare logits with the GGUF-loaded model")
    args = ap.parse_args(argv)
    if not args.gguf.is_file():
        print(f"gguf_to_hf: {args.gguf}: no such file", file=sys.stderr)
        return 2
    info = convert(args.gguf, args.out, args.dtype)
    print(f"gguf_to_hf: {info['architecture']}, {info['tensors']} tensors, {info['params']:,} params ({info['dtype']}) "
          f"in {info['out']} in {info['seconds']} s; eos {info['eos_token_id']}")
    if args.check:
        diff = check(args.gguf, args.out)
        print(f"gguf_to_hf: max |logit diff| vs the GGUF-loaded model: {diff:.4g} (bf16 weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
