"""Sample text from a trained GPT: ``python scripts/generate.py CKPT_OR_EXPORT_DIR --prompt "text"
[--max-new-tokens 200] [--temperature 0.8] [--top-k 50] [--device cuda] [--dtype float32] [--seed 0]``.

The source is a Lightning checkpoint (``.ckpt``, read without a Trainer) or a directory written by
``flashtrain.trainer.export.export``. Text is UTF-8 bytes (ids 0..255; the end-of-document id 256 ends the sample,
and ids >= 256 are left out of the printed text), or a ``tokenizers`` tokenizer.json: the one the export's config
names (data.tokenizer) or ``--tokenizer PATH``. Prints the prompt and its continuation. Without CUDA the kernels run
through Triton's interpreter (slow; float32 or float64, no bfloat16).
"""

from __future__ import annotations

import argparse
import os

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
BYTE_EOD = 256  # flashtrain.trainer.data.BYTE_EOD: the byte vocabulary's end-of-document id


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Sample text from a flashtrain GPT checkpoint or export.")
    parser.add_argument("source", help="a Lightning .ckpt file or an export directory (model.safetensors, config.json)")
    parser.add_argument("--prompt", default="", help="the text to continue (default: empty, starts a document)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy decoding")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="a tokenizers tokenizer.json (default: the config's, "
                                                          "else UTF-8 bytes)")
    return parser.parse_args(argv)


class ByteCodec:
    """UTF-8 bytes: ids 0..255, end of document 256."""
    eod = BYTE_EOD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TokenizerCodec:
    """A ``tokenizers`` tokenizer.json; end of document: ``eod_token`` or the first of the trainer's names for it."""

    def __init__(self, path: str, eod_token: int | None = None):
        from tokenizers import Tokenizer

        from flashtrain.trainer.data import EOD_NAMES

        self.tokenizer = Tokenizer.from_file(path)
        if eod_token is None:
            ids = (self.tokenizer.token_to_id(name) for name in EOD_NAMES)
            eod_token = next((i for i in ids if i is not None), None)
        self.eod = eod_token

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def codec(config: dict, tokenizer: str | None):
    """The text codec the model was trained with: ``tokenizer``, else the config's data.tokenizer, else bytes."""
    data = config.get("data") or {}
    path = tokenizer or data.get("tokenizer")
    if path:
        return TokenizerCodec(path, data.get("eod_token"))
    vocab = config["model"]["vocab_size"]
    if vocab <= BYTE_EOD:
        raise SystemExit(f"the model's vocab_size={vocab} has no room for UTF-8 bytes and their end-of-document id "
                         f"{BYTE_EOD}; pass the tokenizer it was trained with: --tokenizer PATH")
    return ByteCodec()


def set_environment(device: str) -> None:
    """Choose Triton's interpreter for a CPU device (as flashtrain.trainer.cli does where there is no GPU): triton
    reads TRITON_INTERPRET when it is first imported, so this runs before anything imports it."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def main(argv=None) -> None:
    args = parse_args(argv)
    set_environment(args.device)
    from flashtrain.trainer.export import load_with_config
    from flashtrain.trainer.generate import generate

    model, config = load_with_config(args.source, device=args.device, dtype=DTYPES[args.dtype])
    text = codec(config, args.tokenizer)
    ids = text.encode(args.prompt)
    if not ids:  # an empty prompt starts a new document
        if text.eod is None:
            raise SystemExit("--prompt is empty and the tokenizer has no end-of-document token to start from; "
                             "pass a prompt")
        ids = [text.eod]
    prompt = torch.tensor([ids], dtype=torch.long)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                   eos_id=text.eod, generator=generator)
    print(text.decode(out[0].tolist()))


if __name__ == "__main__":
    main()
