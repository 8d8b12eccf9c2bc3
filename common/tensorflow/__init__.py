"""Everything in common/ that imports TensorFlow; common/pytorch/ holds the twin of each file.

Its modules import TensorFlow as `import tensorflow as tf`, an absolute import that finds the
real package, never this one. Only a script run from inside common/ (sys.path[0] = common/)
would see this folder as `tensorflow`; none is.
"""
