"""Lending a GPU over the network and taking it back (issue 46): a lease on an RPC server's
devices, which the lender's own machine revokes when its own programs want the GPU.

    channel   what lender and borrower say (JSON lines over TCP), the key's proof, the timings
    lender    `arbiterd rpc-server --lend`'s side: the lender's arena held while lent, the lease
              granted, revoked, ended (threads, in the RPC server's process)
    borrower  the borrower daemon's side: the `rpc:` arena held on the lender's behalf while
              the lease is not granted, so its models release in place as for a local waiter
              (asyncio, in the daemon)
"""
