"""Make PEFT LoRA adapters offline (tests, benchmarks): peft's get_peft_model on a transformers model with random
A and B (init_lora_weights=False, so the adapter changes the tokens), saved with save_pretrained; the model is
handed back without its LoRA layers.

    python -m nanovllm_tp.launch.make_lora OUT_DIR [--model DIR] [--rank 8] [--alpha 16] [--seed 0] [--count 1]
"""
import argparse
import os

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora(hf_model, out_dir, rank: int = 8, alpha: float = 16, seed: int = 0, targets=TARGETS,
              use_rslora: bool = False, gain: float = 1.0) -> str:
    """Write a PEFT adapter of `hf_model` to out_dir (made if need be); returns its path. `gain` scales B (an
    adapter's effect on the tokens grows with it)."""
    import torch
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        use_rslora=use_rslora, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(hf_model, config)
    if gain != 1.0:
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(gain)
    os.makedirs(out_dir, exist_ok=True)
    peft_model.save_pretrained(str(out_dir))
    peft_model.unload()        # the base model as it was
    return str(out_dir)


def main(argv=None) -> None:
    from nanovllm_tp.launch.make_tiny import ensure_tiny
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", help="HF model directory (default: the embedded tiny checkpoint)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=1, help="adapters out_dir/lora-0 .. lora-{count-1}")
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(args.model or str(ensure_tiny()), dtype=torch.float32)
    for i in range(args.count):
        path = os.path.join(args.out_dir, f"lora-{i}") if args.count > 1 else args.out_dir
        print(make_lora(hf, path, args.rank, args.alpha, args.seed + i))


if __name__ == "__main__":
    main()
