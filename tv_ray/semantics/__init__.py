"""The semantics of every op: shape, dtype, concrete float64 and group rules, the type check and the interpreter.

Importing this package registers every rule module, so `RULES` is complete.
"""
from tv_ray.semantics import rules_comm, rules_elementwise, rules_index, rules_reduce, rules_tensor  # noqa: F401
from tv_ray.semantics.check import check_graph
from tv_ray.semantics.interpret import eval_node, run_graph
from tv_ray.semantics.table import RULES, Context, Rule, instantiate_attrs, rule_for

__all__ = ["Context", "RULES", "Rule", "check_graph", "eval_node", "instantiate_attrs", "rule_for", "run_graph"]
