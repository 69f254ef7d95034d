"""Numbered rounds: a member declares itself ready, the coordinator fixes who takes part, every member votes, all
commit the hash of the state they hold. The member side (plan.py) and the coordinator side (barrier.py)."""
