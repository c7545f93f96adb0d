"""The KV page pool: reference-counted pages with hash-based prefix caching.

Every page of the KV cache is in one of two states:
  in use   ref > 0: held by that many running requests (shared prefix pages have ref > 1)
  free     ref == 0: in the LRU `free` list, oldest first; a free page may still hold a
           cached full page of some earlier sequence, reusable until it is evicted

A *full* page (page_size tokens whose k/v are written) is registered under a
hash of its tokens chained with the hash of the page before it, so a hash
stands for the whole prefix up to the end of that page. A new request looks up
its prompt's full-page hashes (`page_hashes`, `lookup`) and takes every cached
page of the leading run (`take`): those tokens are not prefilled again.
`allocate` hands out the least recently freed pages first, forgetting any
prefix they cached.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def page_hash(parent: bytes, tokens) -> bytes:
    """The hash of a full page: its token ids, chained to the previous page's hash."""
    return hashlib.sha256(parent + np.asarray(tokens, np.int64).tobytes()).digest()


def page_hashes(token_ids: list[int], page_size: int, known: list[bytes]) -> list[bytes]:
    """The hashes of every full page of token_ids, extending `known` (a prefix of them,
    kept by the caller so that each page is hashed once) in place."""
    for i in range(len(known), len(token_ids) // page_size):
        known.append(page_hash(known[-1] if i else b"",
                               token_ids[i * page_size:(i + 1) * page_size]))
    return known


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.ref = [0] * num_pages
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self.hash_of: dict[int, bytes] = {}  # page -> hash of the prefix it caches
        self.page_of: dict[bytes, int] = {}  # hash -> page

    @property
    def num_free(self) -> int:
        return len(self.free)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached pages for the longest leading run of these full-page hashes (see
        `page_hashes`); nothing is taken (see `take`)."""
        pages = []
        for h in hashes:
            page = self.page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def take(self, pages: list[int]):
        """One more reference to each of these (cached) pages; free ones leave the free list."""
        for page in pages:
            if self.ref[page] == 0:
                del self.free[page]
            self.ref[page] += 1

    def allocate(self, n: int) -> list[int] | None:
        """n blank pages (least recently freed first), or None if fewer are free."""
        if n > len(self.free):
            return None
        pages = []
        for _ in range(n):
            page, _ = self.free.popitem(last=False)
            self.ref[page] = 1
            h = self.hash_of.pop(page, None)  # evicted: the prefix it cached is gone
            if h is not None and self.page_of.get(h) == page:
                del self.page_of[h]
            pages.append(page)
        return pages

    def release(self, pages: list[int]):
        """Drops one reference to each page; unreferenced pages become free (still cached).

        The last page is freed first, so a sequence's tail is evicted before its head
        (the head is the part another request is likelier to share).
        """
        for page in reversed(pages):
            self.ref[page] -= 1
            assert self.ref[page] >= 0, f"page {page} released more often than taken"
            if self.ref[page] == 0:
                self.free[page] = None

    def register(self, page: int, h: bytes):
        """Records that `page` now holds the full page with prefix hash h."""
        if h not in self.page_of:  # an identical page cached elsewhere stays the one found
            self.page_of[h] = page
            self.hash_of[page] = h
