"""elastic_mesh: fault-tolerant communication between nodes that come and go.

It moves tensors and bytes between nodes; it must never import `prime` or know about models,
optimizers or data formats, so that another trainer can use it.
"""
