"""The compact form of a TOPLOC chunk proof: k (position, value) pairs as one polynomial over GF(P).

TOPLOC (arXiv 2501.16007, section 3) commits to the k largest activations of a chunk without spending
bytes on their positions: the pairs (x_i, y_i) (x = flat position in the chunk reduced modulo m, y = the
16 bits of the value) are the points of the unique polynomial of degree < k through them, and the proof
stores its k coefficients. A verifier evaluates the polynomial at the positions of *its own* k largest
activations: where its set agrees with the prover's it reads the prover's value back exactly; where it
does not, it reads a pseudo-random 16-bit word, which almost never has the right sign and exponent.

Layout of one chunk proof: uint16 m, then k uint16 coefficients (lowest degree first), little-endian;
258 bytes for k = 128. Values are fp16 bit patterns (see `prime.verify.proof` for why fp16); the
field's prime P = 65521 is the largest below 2**16, so every coefficient fits in 16 bits, and the 15
patterns at or above P are NaNs, which a finite activation never has.

Pure torch, exact: residues are int64 (a product of two is below 2**32) and sums of products go
through float64 matrix products, exact below 2**53; CPU and GPU give the same bytes.
"""

from __future__ import annotations

import torch

P = 65521  # largest prime below 2**16

_INVERSES: dict[torch.device, torch.Tensor] = {}


def _inverse_table(device: torch.device) -> torch.Tensor:
    """a^(P-2) mod P for every residue a (Fermat), built once per device by square-and-multiply."""
    if device not in _INVERSES:
        base = torch.arange(P, dtype=torch.int64, device=device)
        result = torch.ones_like(base)
        exponent = P - 2
        while exponent:
            if exponent & 1:
                result = result * base % P
            base = base * base % P
            exponent >>= 1
        _INVERSES[device] = result  # inverse of 0 is left 0 and never asked for: nodes are distinct
    return _INVERSES[device]


def pick_modulus(positions: torch.Tensor) -> torch.Tensor:
    """Per row, the largest m ≤ P for which the row's positions stay distinct modulo m.

    Chunks of up to P values (32 tokens × hidden ≤ 2047) never need anything but P; wider models fall
    back to smaller moduli for the rare row whose positions collide.
    """
    moduli = torch.full(positions.shape[:1], P, dtype=torch.int64, device=positions.device)
    if positions.numel() == 0 or int(positions.max()) < P:
        return moduli  # positions are distinct (top-k of one chunk) and already below P
    for row in range(positions.shape[0]):
        m = P
        while torch.unique(positions[row] % m).numel() != positions.shape[1]:
            m -= 1
            if m < positions.shape[1]:
                raise ValueError("no modulus keeps these chunk positions distinct")  # k distinct ints: impossible
        moduli[row] = m
    return moduli


def _powers_by_doubling(x: torch.Tensor, count: int) -> torch.Tensor:
    """x^0 .. x^(count-1) mod P for every element of x (shape [..., count]), in log2(count) steps."""
    out = torch.ones(*x.shape, count, dtype=torch.int64, device=x.device)
    filled, x_to_filled = 1, x % P
    while filled < count:
        width = min(filled, count - filled)
        out[..., filled:filled + width] = out[..., :width] * x_to_filled[..., None] % P
        filled += width
        x_to_filled = x_to_filled * x_to_filled % P
    return out


_POWER_TABLES: dict[tuple[torch.device, int], torch.Tensor] = {}
_POWER_TABLE_ROWS = 1 << 16  # every residue: 65521 × k int64 (64 MiB for k = 128) at most, built once


def powers(x: torch.Tensor, count: int) -> torch.Tensor:
    """x^0 .. x^(count-1) mod P (as float64) for every element of x: rows of a table of all residues'
    powers, built once per device and k, because modular reduction is the slow part of every step here."""
    key = (x.device, count)
    table = _POWER_TABLES.get(key)
    needed = int(x.max()) + 1 if x.numel() else 1
    if table is None or table.shape[0] < needed:
        rows = min(P, max(needed, 4096 if table is None else 2 * table.shape[0]))
        # float64, the type the matrix products below take: exact, and no conversion per call
        table = _powers_by_doubling(torch.arange(rows, dtype=torch.int64, device=x.device), count).double()
        _POWER_TABLES[key] = table
    return table[x]


def _matmul_mod(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(a @ b) mod P, exactly, in float64: each product is below 2**32 and a sum of k ≤ 2**20 of them is
    below 2**53, where float64 still counts every integer; so BLAS does the work and nothing is lost."""
    if a.shape[-1] > 2 ** 20:
        raise ValueError("too many terms for an exact float64 sum")
    return torch.remainder(torch.matmul(a.to(torch.float64), b.to(torch.float64)), P).to(torch.int64)


def _master_polynomial(x: torch.Tensor) -> torch.Tensor:
    """Coefficients (lowest first, [rows, k+1]) of M(t) = prod_i (t - x_i), by a product tree: pairs of
    factors are multiplied level by level (log2 k levels), each level one outer product and one sum
    along its anti-diagonals."""
    rows, k = x.shape
    width = 1 << (k - 1).bit_length()  # pad to a power of two with factors 1 (= polynomial "1")
    factors = torch.zeros(rows, width, 2, dtype=torch.int64, device=x.device)
    factors[:, :k, 0] = (-x) % P
    factors[:, :k, 1] = 1
    factors[:, k:, 0] = 1
    while factors.shape[1] > 1:
        left, right = factors[:, 0::2], factors[:, 1::2]
        degree = left.shape[2]
        outer = left[..., :, None] * right[..., None, :]  # [rows, n, d, d]; below 2**32 each
        diagonal = (torch.arange(degree, device=x.device)[:, None] + torch.arange(degree, device=x.device)).flatten()
        product = torch.zeros(rows, left.shape[1], 2 * degree - 1, dtype=torch.int64, device=x.device)
        product.index_add_(2, diagonal, outer.flatten(2))  # ≤ d terms: far below 2**63
        factors = product % P
    return factors[:, 0, :k + 1]


def interpolate(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Coefficients (lowest degree first, shape [rows, k]) of the polynomial through (x, y) per row.

    Lagrange, arranged so that every step is a batched tensor operation rather than k sequential ones:
    with M(t) = prod (t - x_i), the polynomial is sum_i w_i M(t) / (t - x_i) with w_i = y_i / M'(x_i),
    and its coefficient j is sum_{l>j} m_l S_{l-j-1} with the weighted power sums
    S_p = sum_i w_i x_i^p. So: the powers of the x_i (a table lookup), M' at the x_i and S (two
    matrix products), and a Hankel matrix of M's coefficients (one more). x must be distinct per row.
    """
    rows, k = x.shape
    master = _master_polynomial(x)  # m_0 .. m_k
    derivative = master[:, 1:] * torch.arange(1, k + 1, device=x.device) % P  # M' coefficients, degree k-1
    x_powers = powers(x, k)  # [rows, i, p]
    derivative_at_nodes = _matmul_mod(x_powers, derivative[:, :, None])[..., 0]  # never 0: x distinct
    weights = y % P * _inverse_table(x.device)[derivative_at_nodes] % P
    power_sums = _matmul_mod(weights[:, None, :], x_powers)[:, 0, :]  # S_0 .. S_{k-1}
    padded = torch.cat([master[:, 1:], torch.zeros(rows, k, dtype=torch.int64, device=x.device)], dim=1).double()
    hankel = padded.unfold(1, k, 1)[:, :k]  # a view: [rows, j, p] = m_{j+p+1}
    return _matmul_mod(hankel, power_sums[:, :, None])[..., 0]


def evaluate(coefficients: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each row's polynomial at that row's points: [rows, k] × [rows, n] → [rows, n]."""
    return _matmul_mod(powers(x, coefficients.shape[1]), coefficients[:, :, None])[..., 0]


def pack(moduli: torch.Tensor, coefficients: torch.Tensor) -> list[bytes]:
    """One 2 + 2k byte proof per row."""
    words = torch.cat([moduli[:, None], coefficients], dim=1).to("cpu").to(torch.int32).to(torch.uint16)
    return [row.numpy().astype("<u2").tobytes() for row in words]


def unpack(proofs: list[bytes], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack`; a proof of the wrong length or with a residue outside the field is refused."""
    size = 2 * (k + 1)
    raw = b"".join(proofs)
    if any(len(proof) != size for proof in proofs):
        raise ValueError(f"a chunk proof is {size} bytes for top-k {k}")
    words = torch.frombuffer(bytearray(raw), dtype=torch.uint16).to(torch.int64).view(len(proofs), k + 1)
    moduli, coefficients = words[:, 0], words[:, 1:]
    if bool((moduli < k).any() or (moduli > P).any() or (coefficients >= P).any()):
        raise ValueError("a chunk proof holds a modulus or coefficient outside the field")
    return moduli, coefficients
