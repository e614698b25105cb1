"""Gemma 3 270M's decode speed: attnkit's `generate` or llama.cpp (llama-cpp-python) on the
same GGUF, greedy, one engine and thread count a run (so that runs of two source trees and
llama.cpp can alternate in one sitting).

Decode only: tokens/s from the first generated token to the last (`on_token` timestamps;
llama.cpp's streamed chunks), after one warm-up generation. Prints one line of JSON.

    python benchmarks/gemma3_decode.py --engine attnkit --threads 1 --tokens 128
    python benchmarks/gemma3_decode.py --engine llama.cpp --threads 2 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import time

PROMPT = "The capital of France is"


def attnkit_rate(threads: int, tokens: int) -> tuple[float, str]:
    import numpy as np

    from attnkit.models import AutoCausalLM
    from attnkit.runtime import blas_threads

    model = AutoCausalLM.from_pretrained("gemma3")
    ids = model.tokenizer.encode(PROMPT)
    with blas_threads(threads):
        model.generate(np.array(ids), 8, stop=())  # warm-up: compiled loops, the thread choice
        stamps: list[float] = []
        out = model.generate(np.array(ids), tokens, stop=(), on_token=lambda _: stamps.append(time.perf_counter()))
    text = model.tokenizer.decode([int(t) for t in np.ravel(out)][len(ids):])
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), text


def llama_cpp_rate(threads: int, tokens: int) -> tuple[float, str]:
    from llama_cpp import Llama

    from attnkit.models import gemma3_gguf_path

    llm = Llama(model_path=str(gemma3_gguf_path()), n_threads=threads, n_threads_batch=threads, n_ctx=512,
                verbose=False, seed=0)
    llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)  # warm-up
    stamps, pieces = [], []
    for chunk in llm.create_completion(PROMPT, max_tokens=tokens, temperature=0.0, top_k=1, stream=True):
        stamps.append(time.perf_counter())
        pieces.append(chunk["choices"][0]["text"])
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), "".join(pieces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["attnkit", "llama.cpp"], default="attnkit")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    run = attnkit_rate if args.engine == "attnkit" else llama_cpp_rate
    rate, text = run(args.threads, args.tokens)
    print(json.dumps({"engine": args.engine, "threads": args.threads, "tokens_per_s": round(rate, 2),
                      "text": text[:60]}))


if __name__ == "__main__":
    main()
