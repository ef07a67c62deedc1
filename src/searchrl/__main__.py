from searchrl.app.cli import main

main()
