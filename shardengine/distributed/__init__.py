"""Talking to the other ranks: the process group, collectives and what they cost.

``launch`` joins the process group the launcher describes; ``communicator``
issues collectives over one group (``work``: their handles; ``abort``: why a
rank left); ``traffic`` counts their bytes in the ring model; ``hybrid``
composes the shard group and the replica group; ``compression`` holds the
codecs and the compressed collectives. Only this package calls
``torch.distributed``. It re-exports nothing, so importing a pure module
(``traffic``, ``compression.codecs``) loads no process-group code.
"""
