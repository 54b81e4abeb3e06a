"""Prints the README's set-up commands: the ```bash blocks of its "## Set up" section, one per
line (the first runs the demo, the second the tests)."""

import re
import sys

with open(sys.argv[1], encoding="utf-8") as f:
    text = f.read()
section = re.search(r"^## Set up\n(.*?)(?=^## )", text, re.S | re.M)
if section is None:
    sys.exit("README: no '## Set up' section")
blocks = re.findall(r"^```bash\n(.*?)^```", section.group(1), re.S | re.M)
if len(blocks) != 2:
    sys.exit(f"README: expected 2 bash blocks under '## Set up', found {len(blocks)}")
for block in blocks:
    print(" && ".join(line.strip() for line in block.strip().splitlines()))
