"""`dflash generate`: the target rewrites the assistant turns of the training conversations."""
