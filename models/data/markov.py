"""A random sparse order-k Markov source of tokens, with its exact entropy rate.

Construction (vocabulary V, order k, support S, mixing delta = MIX):

    context c = the last k tokens (V^k contexts)
    q(. | c)  = Dirichlet(ALPHA 1_S) weights on S distinct random tokens, 0 elsewhere
    p(. | c)  = (1 - delta) q(. | c) + delta / V

The uniform mix makes every next token possible, so any context reaches any
other in k steps, with positive probability at every step count >= k: the
context chain is irreducible and aperiodic and has a unique stationary
distribution pi, found by power iteration to rounding error. The entropy rate is

    h = sum_c pi(c) H(p(. | c)),   H(p) = -sum_x p(x) ln p(x)          (Cover & Thomas, Thm 4.2.4)

A training window starts at a stationary point (the stream starts from a
context drawn from pi), and the model predicting position t sees the t + 1
tokens x_0..x_t of its window only. With m = t + 1 tokens of context,

    f(m) = H(X_m | X_0..X_{m-1}) = H(pi_{m+1}) - H(pi_m)   for m < k
    f(m) = h                                                 for m >= k

where pi_j is the marginal of pi on the first j tokens of a context (H(pi_0) = 0).
The loss floor of windows of length T is the mean of f(t + 1) over t = 0..T-1.
"""

from __future__ import annotations

import math
from bisect import bisect_right

import numpy as np

MIX = 0.01  # delta: uniform mass mixed into every next-token distribution
ALPHA = 1.0  # Dirichlet concentration of the S sparse weights (uniform on the simplex)
MAX_TABLE = 1 << 20  # V^(k+1) transition probabilities at most (8 MiB of float64)


def entropy(p: np.ndarray, axis=-1) -> np.ndarray:
    """-sum p ln p along `axis`, in nats, with 0 ln 0 = 0."""
    return -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=axis)


class MarkovSource:
    """The transition table `P` (V^k, V), its stationary `pi` (V^k,) and entropies.

    A context (c_1..c_k), oldest first, has index sum_j c_j V^(k-j); after
    emitting x the next context is (c_2..c_k, x) = (c V + x) mod V^k.
    """

    def __init__(self, vocab: int, order: int, support: int, seed: int):
        if not 1 <= support <= vocab:
            raise ValueError(f"support {support} must be in [1, vocab {vocab}]")
        if vocab ** (order + 1) > MAX_TABLE:
            raise ValueError(f"vocab^(order+1) = {vocab ** (order + 1)} exceeds {MAX_TABLE}")
        self.vocab, self.order, self.support, self.seed = vocab, order, support, seed
        V, n_ctx = vocab, vocab**order
        rng = np.random.default_rng([seed, 0])
        tokens = np.argsort(rng.random((n_ctx, V)), axis=1)[:, :support]  # (V^k, S) distinct
        weights = rng.dirichlet(np.full(support, ALPHA), size=n_ctx)  # (V^k, S)
        self.P = np.full((n_ctx, V), MIX / V)  # (V^k, V)
        np.put_along_axis(self.P, tokens, MIX / V + (1 - MIX) * weights, axis=1)
        self.pi = self.stationary()  # (V^k,)
        self.H_next = entropy(self.P)  # (V^k,) H(p(. | c))
        self.entropy_rate = float(self.pi @ self.H_next)

    def step(self, pi: np.ndarray) -> np.ndarray:
        """pi P over contexts: new(c_2..c_k, x) = sum_{c_1} pi(c_1..c_k) p(x | c_1..c_k)."""
        V, rest = self.vocab, len(pi) // self.vocab
        P = self.P.reshape(V, rest, V)  # (c_1, c_2..c_k, x)
        return np.einsum("fr,frx->rx", pi.reshape(V, rest), P).ravel()  # (V^k,)

    def stationary(self, max_iter: int = 100_000) -> np.ndarray:
        """pi = pi P by power iteration on the lazy chain (I + P) / 2, to rounding error.

        The lazy chain has the same pi, and its eigenvalues (1 + lambda) / 2 stay
        away from -1, so a nearly periodic P cannot make the iterates oscillate.
        One step rounds each entry by about V ulps; iteration stops once it moves
        pi by less than 8 V eps in L1.
        """
        tol = 8 * self.vocab * np.finfo(np.float64).eps
        pi = np.full(len(self.P), 1.0 / len(self.P))  # (V^k,)
        for _ in range(max_iter):
            new = 0.5 * (pi + self.step(pi))
            new /= new.sum()
            if np.abs(new - pi).sum() < tol:
                return new
            pi = new
        raise RuntimeError(f"the Markov chain did not mix in {max_iter} steps; "
                           "lower --markov-order or raise --markov-support")

    def conditional_entropy(self, m: int) -> float:
        """f(m) = H(X_m | X_0..X_{m-1}) in the stationary process, m >= 1 tokens of context."""
        if m >= self.order:
            return self.entropy_rate
        joint = self.pi.reshape((self.vocab,) * self.order)  # (V,) * k
        pm1 = joint.sum(axis=tuple(range(m + 1, self.order))).ravel()  # pi_{m+1} (V^(m+1),)
        pm = joint.sum(axis=tuple(range(m, self.order))).ravel()  # pi_m (V^m,)
        return float(entropy(pm1) - entropy(pm))

    def floor(self, seq_len: int) -> float:
        """Mean of f(t + 1) over the T positions of a window: the loss floor in nats."""
        return sum(self.conditional_entropy(t + 1) for t in range(seq_len)) / seq_len

    def sample(self, n_tokens: int, draw: int = 0) -> np.ndarray:
        """A stationary stream of `n_tokens` tokens, (n_tokens,) int64, fixed by the seed;
        `draw` > 0 gives another stream of the same source (a held-out set).

        The first k tokens are a context drawn from pi; each next token is the
        inverse CDF of p(. | c) at a uniform draw, found by bisection.
        """
        V, k, n_ctx = self.vocab, self.order, len(self.P)
        rng = np.random.default_rng([self.seed, 1, *([draw] if draw else [])])
        c = int(rng.choice(n_ctx, p=self.pi))
        first = [(c // V ** (k - 1 - j)) % V for j in range(k)]  # c_1..c_k, oldest first
        cdf = np.cumsum(self.P, axis=1)  # (V^k, V)
        cdf[:, -1] = 1.0  # u < 1 always lands on a token
        rows = cdf.tolist()
        out = first + [0] * max(0, n_tokens - k)
        for t, u in enumerate(rng.random(max(0, n_tokens - k)).tolist(), start=k):
            x = bisect_right(rows[c], u)
            out[t] = x
            c = (c * V + x) % n_ctx
        return np.array(out[:n_tokens], dtype=np.int64)

    def describe(self) -> dict:
        """JSON-able parameters; conditional_entropy lists f(1)..f(k), f(k) = entropy_rate."""
        return {"order": self.order, "support": self.support, "mix": MIX, "alpha": ALPHA,
                "entropy_rate": self.entropy_rate, "uniform_loss": math.log(self.vocab),
                "conditional_entropy": [self.conditional_entropy(m)
                                        for m in range(1, self.order + 1)]}
