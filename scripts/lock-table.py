#!/usr/bin/env python3
"""Rewrites the lock table in docs/ARCHITECTURE.md §7 from src/lock/rank.rs (the code is the
source; `lock::tests::the_architecture_lock_table_is_the_code_s` checks the two agree)."""
import pathlib
import re

root = pathlib.Path(__file__).resolve().parent.parent
rank = (root / "src/lock/rank.rs").read_text()
rows = re.findall(r'^\s+(\w+) = (\d+), "([^"]+)", "([^"]+)";', rank, re.M)
table = "| rank | lock | guards |\n|---|---|---|\n" + "".join(
    f"| {n} | `{name}` | {guards} |\n" for _, n, name, guards in rows
)
doc_path = root / "docs/ARCHITECTURE.md"
doc = doc_path.read_text()
start = doc.index("## 7. Locks")
t0 = doc.index("| rank | lock | guards |", start)
t1 = doc.index("\n\n", t0)
doc_path.write_text(doc[:t0] + table.rstrip("\n") + doc[t1:])
print(f"{len(rows)} ranks written to docs/ARCHITECTURE.md §7")
