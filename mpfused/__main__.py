"""`python -m mpfused`: prints what the installed extension was built with."""

import argparse
import json

import torch

import mpfused

parser = argparse.ArgumentParser(prog="python -m mpfused", description=__doc__.strip("`").split(": ", 1)[1])
parser.add_argument("--json", action="store_true", help="print it as one JSON object")
args = parser.parse_args()

info = dict(mpfused.build_info())
info["torch (running)"] = torch.__version__
info["cuda available"] = torch.cuda.is_available()
if args.json:
    print(json.dumps(info, default=str))
else:
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
