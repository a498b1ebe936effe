"""Training utilities: fragment tokenization and FIM/EFIM fine-tuning."""
