"""The tray app and dashboard (PySide6). Only a client of the control socket: the daemon never
imports this package, and nothing outside it imports Qt. Of arbiterd's own modules it imports
only the shared records (events, status, states) and their rendering (render), errors, config
and paths, and the control protocol (control, wire): never the CLI or the daemon
(tests/gui/test_imports.py).

    app          `arbiterd tray`: main(argv), the QApplication, --screenshot
    tray         TrayApp: icon, menu, dashboard and notifications wired to a connection
    connection   DaemonConnection: the control protocol over QLocalSocket, reconnecting
    dashboard    DashboardWindow: header, timeline, model cards, handoff table
    timeline     TimelineWidget: VRAM by owner over time, handoff markers
    icon         render_icon: the tray icon as a pure function of an IconLook
    notify       desktop notifications for failures, each replacing the last

Without Qt (pure, tested without a display):

    state        TrayState: what every view shows, from statuses and events
    history      VRAM samples, handoffs and waits of the last minutes (events, no I/O)
    palette      a stable colour per model; red, amber, grey
    replay       recorded sessions (JSON lines) for --screenshot --replay
    autostart    the XDG autostart entry behind "Start at login"
    launch       how "Start daemon" starts one
"""
