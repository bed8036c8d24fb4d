"""What the model is: parameter counts and shapes from a count, a Hugging Face config or a module."""
