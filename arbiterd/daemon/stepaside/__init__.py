"""The daemon's own hold of the GPU: for the user (game mode, `arbiterd hold`) and for GPU
programs that do not take part in the protocol (issue 45): a game, ComfyUI or Blender started
the usual way gets the GPU, and the models come back when it is gone.

    hold      gpu0's token, held while the user or a program stepped aside for wants it
    programs  the device nodes, and which of the user's processes hold them open (/proc)
    lookout   inotify on the nodes, and the looks that follow a ring or a timer
    policy    pure: which program the daemon steps aside for, and when that ends ([yield])
    aside     the step aside in force, acted on through the daemon's hold (hold)
    leases    lent RPC devices (issue 46): each held for its lender while the lease is not
              granted, so the models release for the lender's programs too (arbiterd/lease/)
"""
