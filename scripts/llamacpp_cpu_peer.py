"""llama.cpp's CPU build as scripts/bench_cpu.py's peer: run by the interpreter that has
llama-cpp-python (`--llamacpp-python`), it loads the model once, then times what it is asked.

It answers one JSON line on stdout for each JSON line read on stdin:

- {"op": "load", "model": PATH, "threads": T, "n_ctx": N, "n_batch": B, "flash_attn": F}:
  `Llama(PATH, n_threads=T, n_threads_batch=T, n_ctx=N, n_batch=B, flash_attn=F,
  verbose=False)`; answers {"ok": true, "pid", "load_s", "n_vocab", "version",
  "system_info"}.
- {"op": "prompt", "tokens": [...]}: the prompt's prefill (`eval`, from an empty context)
  and the argmax of its last logits, timed: {"ok": true, "seconds", "first_token"}.
- {"op": "decode", "tokens": [id], "n_decode": N}: the token's `eval` (not timed), then N
  greedy steps, each the `eval` of the token before and the argmax of its logits, timed:
  {"ok": true, "seconds", "last_token"}.
- {"op": "quit"}: exits.

A request that fails answers {"ok": false, "error": TEXT}. The protocol has the process's own
stdout; anything else written to file descriptor 1 (llama.cpp's C code) goes to stderr.
"""

import json
import os
import sys
import time


def protocol_stream():
    """The original stdout for replies; fd 1 then points at stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


class Peer:
    def __init__(self):
        self.llm = None
        self.np = None
        self.llama_cpp = None

    def load(self, request):
        start = time.perf_counter()
        import llama_cpp
        import numpy as np

        threads = int(request["threads"])
        self.llm = llama_cpp.Llama(
            model_path=request["model"],
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=int(request["n_ctx"]),
            n_batch=int(request.get("n_batch", 512)),
            flash_attn=bool(request.get("flash_attn", False)),
            verbose=False,
        )
        self.np, self.llama_cpp = np, llama_cpp
        info = llama_cpp.llama_print_system_info()
        return {
            "pid": os.getpid(),
            "load_s": time.perf_counter() - start,
            "n_vocab": self.llm.n_vocab(),
            "version": getattr(llama_cpp, "__version__", None),
            "system_info": info.decode(errors="replace") if isinstance(info, bytes) else info,
        }

    def argmax_last(self):
        """The id of the largest of the last evaluated token's logits (greedy sampling)."""
        logits = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(self.np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),)).argmax())

    def prompt(self, request):
        tokens = [int(t) for t in request["tokens"]]
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(tokens)
        first = self.argmax_last()
        return {"seconds": time.perf_counter() - start, "first_token": first}

    def decode(self, request):
        self.llm.reset()
        self.llm.eval([int(t) for t in request["tokens"]])
        token = self.argmax_last()
        start = time.perf_counter()
        for _ in range(int(request["n_decode"])):
            self.llm.eval([token])
            token = self.argmax_last()
        return {"seconds": time.perf_counter() - start, "last_token": token}


def main():
    out = protocol_stream()
    peer = Peer()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            op = request.get("op")
            if op == "quit":
                break
            if op not in ("load", "prompt", "decode"):
                raise ValueError(f"unknown op {op!r}")
            if op != "load" and peer.llm is None:
                raise RuntimeError("no model loaded")
            reply = {"ok": True, **getattr(peer, op)(request)}
        except Exception as e:  # every failure is an answer, not a crash
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
