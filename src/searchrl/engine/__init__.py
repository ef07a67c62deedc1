"""The training engine: the only layer that imports accelerate and DeepSpeed (one CPU, DDP, ZeRO-2/3, LoRA or
full parameters), the trainer's run loop and its steps, checkpoints, metrics, collapse guards, precision."""
