"""Exhaustive search for a faster E2M1 -> bf16x2 decode: where to put the eight codes of a 32-bit word.

The small-M kernel turns each 32-bit code word (eight E2M1 codes) into the four bf16x2 A-fragment registers
of one mma.m16n8k16 sub-tile. A register holds two codes as ``value * 2^-126`` in bf16 bits: sign at bit 15,
e1 e0 m at bits 8..6, the same at +16 for the high half — target mask ``0x81C081C0``. Today's record layout
(nibble ``p + 4h`` = register ``p``, half ``h``) needs three instructions per register (isolate the nibble
pair, a multiply that makes two shifted copies, mask) plus one shift per word: 13 per word.

If the packer may put the code bits anywhere in the word, a register can come out of

* ``rotl(w, r) & 0x81C081C0`` — one funnel shift + one ``lop3`` (just the ``lop3`` for ``r = 0``), or
* ``((w & m) * K) & 0x81C081C0`` with ``K`` a sum of powers of two whose shifted copies of ``m``'s bits are
  disjoint (no carries) — mask, multiply, mask: three instructions.

This script searches every set of rotations and every such multiplier and prints what exists: no placement
serves all four registers with rotations (the sign-to-magnitude gap makes any four rotated patterns collide),
but three rotations plus one multiplier register cover the word — 8 instructions instead of 13. It also checks
the found decode against the direct one for random words. Pure Python; writes JSON next to the other results.

    python benchmarks/decode_layout_search.py [--json benchmarks/results/decode_layout_search.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

MASK = 0x81C081C0
# bit of the target bf16x2 pattern for (half h, code bit b), b: 0 = m, 1 = e0, 2 = e1, 3 = sign
TARGET = {(h, b): 16 * h + (6, 7, 8, 15)[b] for h in (0, 1) for b in range(4)}
TARGET_BITS = sorted(TARGET.values())


def rot_sources(r: int) -> frozenset[int]:
    """Word bits that ``rotl(w, r) & MASK`` reads."""
    return frozenset((t - r) % 32 for t in TARGET_BITS)


def rotation_sets() -> list[tuple[int, ...]]:
    """Sets of rotations whose source bits are pairwise disjoint, largest first."""
    found = []
    for n in (4, 3):
        for rs in itertools.combinations(range(32), n):
            bits = [rot_sources(r) for r in rs]
            if len(frozenset().union(*bits)) == 8 * n:
                found.append(rs)
        if found:
            break
    return found


def multiplier_for(left: list[int]) -> tuple[tuple[int, ...], dict[int, int]] | None:
    """Shifts c_i such that ``((w & mask(left)) * sum 2^c_i) & MASK`` is a register: the shifted copies of the
    ``left`` bits are pairwise disjoint below bit 32 and cover every target bit from a distinct source."""
    for n in (2, 3, 4):
        for cs in itertools.combinations(range(32), n):
            copies = [{b + c for b in left if b + c < 32} for c in cs]
            seen: set[int] = set()
            if any(seen & cp or seen.update(cp) for cp in copies):
                continue
            src = {}
            for t in TARGET_BITS:
                hits = [t - c for c in cs if t - c in left]
                if len(hits) == 1:
                    src[t] = hits[0]
            if len(src) == 8 and len(set(src.values())) == 8:
                return cs, src
    return None


def decode_direct(codes: list[int]) -> int:
    """The register of codes (low half, high half) built bit by bit."""
    reg = 0
    for h, c in enumerate(codes):
        for b in range(4):
            reg |= ((c >> b) & 1) << TARGET[(h, b)]
    return reg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "decode_layout_search.json")
    args = ap.parse_args()
    full = rotation_sets()
    result: dict = {"four_rotations_exist": len(full[0]) == 4 if full else False}
    print(f"four registers from rotations alone: {'possible' if result['four_rotations_exist'] else 'impossible'}")
    plan = None
    for rs in full:  # prefer a set containing rotation 0 (that register is one lop3)
        left = sorted(set(range(32)) - frozenset().union(*(rot_sources(r) for r in rs)))
        m = multiplier_for(left)
        if m is not None and (plan is None or (0 in rs and 0 not in plan["rotations"])):
            plan = {"rotations": list(rs), "mult_shifts": list(m[0]), "mult_mask": sum(1 << b for b in left),
                    "mult_sources": {str(t): s for t, s in m[1].items()}}
    result["plan"] = plan
    if plan is None:
        print("no three rotations + one multiplier register cover a word")
    else:
        k = sum(1 << c for c in plan["mult_shifts"])
        ops = sum(1 if r == 0 else 2 for r in plan["rotations"]) + 3
        result["instructions_per_word"] = {"found": ops, "current_layout": 13}
        print(f"rotations {plan['rotations']}, fourth register ((w & {plan['mult_mask']:#010x}) * {k:#x}) & "
              f"{MASK:#010x}: {ops} instructions per word (current layout: 13)")
        # place random codes by the plan and check every register against the direct construction
        rng = random.Random(0)
        sources = [{t: (t - r) % 32 for t in TARGET_BITS} for r in plan["rotations"]]
        sources.append({int(t): s for t, s in plan["mult_sources"].items()})
        for _ in range(20000):
            codes = [[rng.randrange(16), rng.randrange(16)] for _ in range(4)]
            w = 0
            for reg, src in zip(codes, sources):
                for (h, b), t in TARGET.items():
                    w |= ((reg[h] >> b) & 1) << src[t]
            got = [(((w << r) | (w >> (32 - r))) & 0xFFFFFFFF if r else w) & MASK for r in plan["rotations"]]
            got.append((((w & plan["mult_mask"]) * k) & 0xFFFFFFFF) & MASK)
            assert got == [decode_direct(c) for c in codes], (codes, hex(w))
        result["checked_random_words"] = 20000
        print("checked on 20000 random words: every register equals the direct decode")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
