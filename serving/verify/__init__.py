"""Packed draft trees and their verification: the data path every step, backend and drafter shares.

tree_batch.py   a batch of draft trees packed into [B, T] rows with their ancestor relation
acceptance.py   which draft tokens the target accepts: greedy, the sampling walk, multi-step
                speculative sampling
"""
