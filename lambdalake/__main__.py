from lambdalake.cli import main

main()
