"""Runs a page's python blocks the way a reader runs them: ``python run_blocks.py blocks.json`` in a fresh interpreter
of the project's environment (no test fixture, no stub; the blocks' own imports), in order, in one namespace (a later
block may use an earlier block's names), each compiled under its page and line so that a traceback points into the
page. After each block it prints ``END_OF_BLOCK`` on a line of its own, so the test can hand each block its output.
"""

import json
import sys

END_OF_BLOCK = "----- end of docs block -----"

if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as file:
        blocks = json.load(file)  # [[where, code], ...]
    namespace = {"__name__": "__main__"}
    for where, code in blocks:
        exec(compile(code, where, "exec"), namespace)
        print(END_OF_BLOCK, flush=True)
