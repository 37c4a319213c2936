"""Hosts one real ``sgl.Engine`` on the CPU in its own process and serves JSON requests over stdin/stdout.

The end-to-end tests talk to it instead of importing SGLang's CPU engine into pytest's own process
(SGLang reads ``SGLANG_USE_CPU_ENGINE`` once, at import, in every module). Protocol: one JSON object
per line on stdin (``{"op": "generate", "kwargs": {...}}`` or ``{"op": "shutdown"}``); each answer is
one stdout line ``@@treespec@@ {"ok": ..., "result" | "error": ..., "seconds": ...}``.
Usage: ``python engine_host.py '<engine kwargs as JSON>'``.
"""

import json
import os
import sys
import time
import traceback

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # SGLang torch.compiles select_top_k (20 s, same output)

from treespec_sglang.plugin import cpu  # noqa: E402

MARK = "@@treespec@@ "


def reply(**kw):
    sys.stdout.write(MARK + json.dumps(kw) + "\n")
    sys.stdout.flush()


def main():
    kwargs = json.loads(sys.argv[1])
    cpu.install()  # before sglang.srt is imported: its engine module imports the ops at import time
    defaults = kwargs.pop("treespec_defaults", None)
    import sglang as sgl

    import treespec_sglang

    if defaults:
        treespec_sglang.configure(defaults["policy"], defaults.get("config", {}))
    t = time.time()
    try:
        llm = sgl.Engine(**kwargs)
    except Exception as e:  # report, then exit
        reply(ok=False, error=f"{type(e).__name__}: {e}", seconds=time.time() - t)
        return
    reply(ok=True, result="started", seconds=time.time() - t)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "shutdown":
            break
        t = time.time()
        try:
            out = llm.generate(**msg["kwargs"])
            reply(ok=True, result=out, seconds=time.time() - t)
        except Exception as e:
            traceback.print_exc()  # to the host's log
            reply(ok=False, error=f"{type(e).__name__}: {e}", seconds=time.time() - t)
    llm.shutdown()
    reply(ok=True, result="stopped", seconds=0.0)


if __name__ == "__main__":
    main()
