"""`python -m mpfused`: prints what the installed extension was built with."""

import torch

import mpfused

info = mpfused.build_info()
width = max(len(k) for k in info)
for key, value in info.items():
    print(f"{key:<{width}}  {value}")
print(f"{'torch (running)':<{width}}  {torch.__version__}")
print(f"{'cuda available':<{width}}  {torch.cuda.is_available()}")
