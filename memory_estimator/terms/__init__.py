"""What each byte is: parameters, gradients, optimizer states, activations, logits, overheads,
the fine-tuning and kernel terms, each as a pure function of the model and the setup."""
