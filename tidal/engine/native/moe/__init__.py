"""Mixture-of-experts building blocks of the native engine, one concept per module:

- :mod:`.router`: the router's scores and top-k choice (and the trainer's replay of a given choice);
- :mod:`.dispatch`: grouping the (token, slot) pairs by expert and combining the expert outputs back;
- :mod:`.experts`: the stacked expert weights of ``transformers`` 5 and their grouped GEMM;
- :mod:`.block`: the sparse MoE block a decoder layer uses in place of its dense MLP.
"""
