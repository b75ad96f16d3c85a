"""The replica rule of replica_policy.py, compiled with numba: one pass over a layer call's
(token, choice) entries, no array temporaries the size of the batch beyond the open entries'.

Called only through replica_policy.route (which builds the tables and checks the policy); the
numba-free `route_entries.py_func` is the same code, which the tests run for line coverage and
compare with the compiled one.
"""

from __future__ import annotations

import numba
import numpy as np

LOCALITY, LEAST_LOADED, ROUND_ROBIN = 0, 1, 2  # replica_policy.POLICIES' order
GOLDEN_RATIO_FRACTION = 0.6180339887498949


@numba.njit(cache=True, nogil=True)
def route_entries(experts, home, top_k, first, group_of, table_t, counts, num_replicated, num_devices, policy,
                  counters, devices_per_node, exact_entries, min_headroom, out):
    """The rule, compiled: one pass sets every entry to its expert's first replica and counts the
    single-replica experts' entries per device; round_robin then deals each replicated expert's
    entries in turn from its counter; least_loaded and locality deal each open entry to one of its
    allowed candidates in proportion to their headroom below the step's balanced level (entries /
    devices, at least `min_headroom`): the candidate whose cumulative weight first exceeds the
    entry's point of the total. Up to `exact_entries` open entries the point of the r-th of a key's n
    entries is (r + 1/2) / n, so every split is exact to one entry; beyond, where one entry is a
    small share, it is frac(entry index * golden ratio) (a Weyl sequence, evenly spread over
    [0, 1)), which needs no ranking. Locality's key keeps three kinds of entry apart so they never
    shift each other: those that stay on their token's device (only it is allowed), those that stay
    on their node (only its replicas), and the rest (any). The same batch gives the same answer on
    every rank."""
    M, R = experts.size, table_t.shape[0]
    fixed = np.zeros(num_devices + 1)
    opened = np.empty(M, dtype=np.int64)
    n_open = 0
    for i in range(M):
        e = experts[i]
        out[i] = first[e]
        if group_of[e] >= 0:
            opened[n_open] = i
            n_open += 1
        else:
            fixed[first[e]] += 1.0
    if n_open == 0:
        return
    if policy == ROUND_ROBIN:
        taken = np.zeros(first.size, dtype=np.int64)
        for j in range(n_open):
            i = opened[j]
            e = experts[i]
            rank = taken[e] + (counters[e] if counters.size else 0)
            taken[e] += 1
            out[i] = table_t[rank % counts[e], e]
        if counters.size:
            counters += taken
        return
    room = np.empty(num_devices + 1)
    level = M / num_devices
    for d in range(num_devices):
        room[d] = max(level - fixed[d], min_headroom)
    room[num_devices] = 0.0  # what a padded (-1) replica column indexes
    kinds = 1
    if policy == LOCALITY:
        kinds = 2 + ((num_devices + devices_per_node - 1) // devices_per_node if devices_per_node else 0)
    key = np.empty(n_open, dtype=np.int64)
    mask = np.zeros((n_open, R), dtype=np.bool_)  # the candidates each entry may take
    for j in range(n_open):
        i = opened[j]
        e = experts[i]
        kind = 0
        if policy == LOCALITY:
            h = home[i // top_k]
            for r in range(R):
                if table_t[r, e] == h:
                    mask[j, r] = True
                    kind = 1
            if kind == 0 and devices_per_node:
                node = h // devices_per_node
                for r in range(R):
                    c = table_t[r, e]
                    if c >= 0 and c // devices_per_node == node:
                        mask[j, r] = True
                        kind = 2 + node
        if kind == 0:
            for r in range(R):
                mask[j, r] = True
        key[j] = group_of[e] * kinds + kind
    exact = n_open <= exact_entries
    per_key = np.zeros(num_replicated * kinds, dtype=np.int64)
    if exact:
        for j in range(n_open):
            per_key[key[j]] += 1
    seen = np.zeros(num_replicated * kinds, dtype=np.int64)
    cumulative = np.empty(R)
    for j in range(n_open):
        i = opened[j]
        e = experts[i]
        total = 0.0
        for r in range(R):
            c = table_t[r, e]
            if mask[j, r] and c >= 0:
                total += room[c]
            cumulative[r] = total
        if exact:
            point = (seen[key[j]] + 0.5) / per_key[key[j]] * total
            seen[key[j]] += 1
        else:
            x = i * GOLDEN_RATIO_FRACTION
            point = (x - np.floor(x)) * total
        row = 0
        for r in range(R - 1):
            if cumulative[r] <= point:
                row += 1
        out[i] = table_t[row, e]
