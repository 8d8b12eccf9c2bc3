"""Everything in common/ that imports PyTorch; common/tensorflow/ holds the twin of each file."""
