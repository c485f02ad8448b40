"""qerl: quantization-enhanced reinforcement learning of LLMs (NVFP4 backbone + LoRA + AQN)."""

__version__ = "0.1.0"
