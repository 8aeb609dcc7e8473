"""`python -m nanovllm_tp.bench [KIND] [flags]`: as `nanovllm-tp bench` (throughput by default)."""
import sys

from nanovllm_tp.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
