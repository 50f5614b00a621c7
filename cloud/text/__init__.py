"""The text side of a model, torch-free: a chat request rendered to prompt token ids, its images
located."""
