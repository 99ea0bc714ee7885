"""The procedure and the command line, the top of the stack: ``checks/`` and ``stages/`` judge the evidence,
``procedure/`` runs the stages in the accuracy guide's order and writes the report, ``cli/`` is ``align``."""
