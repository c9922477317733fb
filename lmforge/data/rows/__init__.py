"""Fine-tuning rows: SFT conversations, preference pairs, RL prompts with their reward fields."""
