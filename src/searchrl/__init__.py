"""searchrl: train and compare LLM search agents with RL and process supervision on one shared base."""

__version__ = "0.1.0"
