"""Compressed gradient and parameter traffic: codecs, PowerSGD, and the collectives built on them.

``codecs`` (int8 blocks, low-precision casts, their byte sizes) and
``powersgd`` (low-rank factors) are tensor math; ``collectives`` runs them
over a communicator.
"""
