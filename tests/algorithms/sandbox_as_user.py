"""Run sandbox cases as whatever user this process is (the test starts it as ``nobody``): JSON cases on stdin, one
JSON result per case on stdout. Loads ``algorithms/sandbox.py`` by its path: it is standard library only, and the
unprivileged user cannot read the project's virtual environment."""

import importlib.util
import json
import os
import sys
import time

spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sandbox
spec.loader.exec_module(sandbox)

results = []
for case in json.loads(sys.stdin.read()):
    code = case["code"].replace("{parent}", str(os.getpid()))
    began = time.perf_counter()
    passed = sandbox.run_test(code, case["test"], sandbox.Limits(timeout_seconds=case["timeout"]), case["namespaces"])
    results.append({"passed": passed, "seconds": time.perf_counter() - began})
print(json.dumps({"uid": os.getuid(), "results": results}))
