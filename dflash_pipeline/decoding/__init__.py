"""Decoding machinery shared by `dflash eval` and training's held-out estimates.

tree.py  DDTree: the draft tree built from one drafter pass, its verification mask and positions, the
         exact acceptance walks (greedy, sampling, reference continuation) and the held-out estimate

Nothing is imported here, so that `dflash --help` stays fast.
"""
